"""The on-disk layout of a published weight version, shared by the writer (common/weights/writer.py, no
vLLM import) and the `file` engine inside vLLM (rollout/vllm_plugin/file_engine.py).

A version is the directory `<weight_dir>/v<N>/` holding `model-<i>-of-<K>.safetensors` shards
(5-digit numbers, HF's naming) and the index `model.safetensors.index.json`. While it is written it
lives in a temporary directory where each shard appears by an atomic rename once whole; with several
trainer ranks each writes its own consecutive run of shard numbers (rank 0 the first) into that same
directory. A writer whose write fails leaves an `ABORTED` file there saying why, so a worker
streaming the version stops instead of waiting. The index is written last, once every rank is done:
HF's format (`metadata.total_size`, `weight_map` tensor -> file) plus our key `shards`, file ->
{"bytes", "crc32"} (zlib's CRC-32 of the whole file), which a reader of the committed version checks
before loading a shard, and, for a version published as a delta (common/weights/delta.py), `delta_base`: the
version it must be applied to. A reader streaming the version cannot check: the index does not exist yet.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ABORT_MARKER = "ABORTED"
DELTA_META_KEY = "slipstream_delta"
"""The safetensors metadata entry of a shard written with delta publishing (common/weights/delta.py)."""
INDEX_NAME = "model.safetensors.index.json"


class CorruptShardError(RuntimeError):
    """A shard of a committed version does not match the size or CRC-32 its index records."""


@dataclass(frozen=True)
class ShardRecord:
    """One shard file as written: what the index records for it."""

    bytes: int
    """Size of the file."""
    crc32: int
    """zlib.crc32 of the file's bytes."""
    tensors: tuple[str, ...]
    """The HF names of the tensors it holds, in file order."""


@dataclass
class PartReport:
    """What one trainer rank wrote into a version (sent back to rank 0, which writes the index)."""

    shards: dict[str, ShardRecord]
    """Shard file name -> its record, in shard order."""
    tensor_bytes: int = 0
    """Bytes of tensor data in those shards as written (the index's `total_size` sums them; a delta's are
    compressed)."""
    delta_base: int | None = None
    """The version this rank's tensors are deltas of (None: written whole)."""


def shard_name(index: int, count: int) -> str:
    """File name of shard `index` (0-based) of a version written as `count` shards."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def write_index(directory: Path, reports: Sequence[PartReport], total_shards: int) -> int:
    """Write the index of a version whose `total_shards` shards the `reports` describe; its total tensor bytes.

    Raises ValueError when the reports do not cover shards 0..K-1 exactly once (a rank wrote another
    number of shards than it announced) or name a tensor twice (two ranks wrote the same tensor).
    """
    shards: dict[str, ShardRecord] = {}
    for report in reports:
        for name, record in report.shards.items():
            if name in shards:
                raise ValueError(f"shard {name} was reported by two ranks")
            shards[name] = record
    expected = [shard_name(i, total_shards) for i in range(total_shards)]
    if sorted(shards) != expected:
        missing, extra = sorted(set(expected) - set(shards)), sorted(set(shards) - set(expected))
        raise ValueError(
            f"the ranks wrote shards that do not make up 0..{total_shards - 1}: missing {missing}, unexpected {extra}; "
            "does each rank's announced shard count match what it wrote (same tensors, same shard size)?"
        )
    weight_map: dict[str, str] = {}
    for name in expected:
        for tensor in shards[name].tensors:
            if tensor in weight_map:
                raise ValueError(f"tensor {tensor!r} is in both {weight_map[tensor]} and {name}")
            weight_map[tensor] = name
    total = sum(r.tensor_bytes for r in reports)
    index: dict[str, object] = {
        "metadata": {"total_size": total},
        "weight_map": weight_map,
        "shards": {name: {"bytes": shards[name].bytes, "crc32": shards[name].crc32} for name in expected},
    }
    bases = {r.delta_base for r in reports} - {None}
    if len(bases) > 1:
        raise ValueError(f"the ranks wrote deltas of different versions {sorted(bases)}")  # type: ignore[type-var]
    if bases:
        index["delta_base"] = bases.pop()
    (directory / INDEX_NAME).write_text(json.dumps(index, indent=1))
    return total


def read_index(directory: Path) -> dict[str, ShardRecord] | None:
    """Shard file name -> record from a version's index; None for a version without one (or without checksums)."""
    path = directory / INDEX_NAME
    if not path.is_file():
        return None
    index = json.loads(path.read_text())
    if "shards" not in index:
        return None
    tensors: dict[str, list[str]] = {name: [] for name in index["shards"]}
    for tensor, name in index.get("weight_map", {}).items():
        tensors.setdefault(name, []).append(tensor)
    return {
        name: ShardRecord(int(s["bytes"]), int(s["crc32"]), tuple(tensors[name])) for name, s in index["shards"].items()
    }


def committed_shards(directory: Path, expected: dict[str, ShardRecord]) -> Iterator[tuple[Path, bytes]]:
    """Each shard file of the committed version in `directory` with its bytes, in name order, each checked against
    `expected` (its index, `read_index`) before it is given; CorruptShardError names the first file that is not."""
    files = sorted(directory.glob("*.safetensors"))
    if missing := sorted(set(expected) - {f.name for f in files}):
        raise CorruptShardError(f"{directory} lacks the shard(s) {missing} that its index lists")
    for f in files:
        if f.name not in expected:
            raise CorruptShardError(f"{f} is not in the version's index; it does not belong")
        data = f.read_bytes()
        verify_shard(f, data, expected[f.name])
        yield f, data


def delta_base(directory: Path) -> int | None:
    """The version a committed version is a delta of (its index's `delta_base`); None for a version written
    whole, or one without an index."""
    path = directory / INDEX_NAME
    if not path.is_file():
        return None
    base = json.loads(path.read_text()).get("delta_base")
    return None if base is None else int(base)


def safetensors_metadata(data: bytes) -> dict[str, str]:
    """The `__metadata__` of a safetensors file held in memory (its header: an 8-byte little-endian length,
    then JSON)."""
    n = int.from_bytes(data[:8], "little")
    return dict(json.loads(data[8 : 8 + n]).get("__metadata__") or {})


def verify_shard(path: Path, data: bytes, expected: ShardRecord) -> None:
    """Raise CorruptShardError unless `data`, the bytes read from `path`, has the size and CRC-32 of `expected`."""
    if len(data) != expected.bytes:
        raise CorruptShardError(
            f"{path}: {len(data)} bytes, the version's index says {expected.bytes}; the file is truncated or replaced"
        )
    crc = zlib.crc32(data)
    if crc != expected.crc32:
        raise CorruptShardError(
            f"{path}: CRC-32 {crc:#010x}, the version's index says {expected.crc32:#010x}; the file is corrupt"
        )
