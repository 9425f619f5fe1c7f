"""The index of an experiment's weight versions on disk: where a run's versions live (`weight_root`), the
committed `v<N>/` directories and the unfinished `.v<N>.<pid>.tmp/` ones a publisher that died mid-write
left, the pinned versions that pruning to the newest `keep_versions` leaves alone, and the newest number the
experiment ever used. A version number names one set of weights for the whole experiment: a publish takes a
number above `newest_version`, so a number never names two different sets of weights. No torch.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path

import redis.asyncio

from common.config import RolloutConfig
from common.keys import Keys
from common.weights.fleet import current_version, read_records
from common.weights.index import delta_base

FILE_BACKENDS = ("file", "collective")
"""The transports whose versions are committed as `v<N>/` directories (a worker catching up, the evaluator's
pinned worker and a republish load those)."""

_VERSION_DIR = re.compile(r"^v(\d+)$")
_TMP_DIR = re.compile(r"^\.v(\d+)\.\d+\.tmp$")
# Versions kept whatever keep_versions says (a JSON list in the weight dir).
PINS_NAME = "pinned.json"


def weight_root(ro: RolloutConfig, run_dir: str | os.PathLike[str]) -> Path:
    """Where a run publishes its versions (`v<N>/` directories): rollout.weight_dir, else `<run dir>/weights`."""
    return Path(ro.weight_dir) if ro.weight_dir else Path(run_dir) / "weights"


def version_dir(root: Path, version: int) -> Path:
    """The directory of a committed version."""
    return root / f"v{version}"


def temp_dir(root: Path, version: int) -> Path:
    """Where this process writes (or links) a version before renaming it to `version_dir`."""
    return root / f".v{version}.{os.getpid()}.tmp"


def version_of_dir(path: Path) -> int | None:
    """The version a directory holds by its name (`v<N>` committed, `.v<N>.<pid>.tmp` being written); None for
    another name."""
    m = _VERSION_DIR.match(path.name) or _TMP_DIR.match(path.name)
    return int(m[1]) if m else None


def committed_versions(root: Path) -> list[int]:
    """Numbers of the committed version directories under root, ascending."""
    return sorted(int(m[1]) for p in root.glob("v*") if (m := _VERSION_DIR.match(p.name)) and p.is_dir())


def unfinished_versions(root: Path) -> list[Path]:
    """Temporary directories of versions whose write never committed (a publisher died mid-write)."""
    return sorted(p for p in root.glob(".v*.tmp") if _TMP_DIR.match(p.name) and p.is_dir())


def pin_versions(root: Path, versions: Iterable[int]) -> None:
    """Keep these versions on disk whatever `keep_versions` says (the trainer pins the version its
    generators serve in each checkpoint it keeps: a resume republishes that version's files)."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{PINS_NAME}.{os.getpid()}"
    tmp.write_text(json.dumps(sorted(set(versions))) + "\n")
    os.replace(tmp, root / PINS_NAME)


def pinned_versions(root: Path) -> set[int]:
    path = root / PINS_NAME
    return set(json.loads(path.read_text())) if path.exists() else set()


def prune_versions(root: Path, keep: int) -> list[Path]:
    """Remove all but the newest `keep` version directories, the pinned ones and the versions any of those is a
    delta of (down to its snapshot: a reader rebuilds it from them); the removed paths."""
    found = committed_versions(root)
    needed = set(found[max(0, len(found) - keep) :]) | pinned_versions(root)
    todo = list(needed)
    while todo:
        base = delta_base(version_dir(root, todo.pop()))
        if base is not None and base not in needed:
            needed.add(base)
            todo.append(base)
    removed = [version_dir(root, v) for v in found if v not in needed]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


async def newest_version(client: redis.asyncio.Redis, keys: Keys, root: Path) -> int | None:
    """The highest version number this experiment ever used, or None: weights:current, the last entry of
    weights:log, the versions workers report, and every version directory under root, committed or not
    (a publisher that died mid-write used its number too: workers may have loaded part of it). A new
    publish takes a higher number, so a number never names two different sets of weights."""
    seen = committed_versions(root)
    seen += [int(_TMP_DIR.match(p.name)[1]) for p in unfinished_versions(root)]  # type: ignore[index]
    if (current := await current_version(client, keys)) is not None:
        seen.append(current)
    for _id, fields in await client.xrevrange(keys.weights_log, count=1) or []:
        seen.append(int((fields or {})["version"]))
    seen += [
        r.weight_version for r in (await read_records(client, keys.workers)).values() if r.weight_version is not None
    ]
    return max(seen, default=None)
