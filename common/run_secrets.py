"""A run's generated bearer tokens: one file, `secrets.json` in the meet dir (0600, like Redis's password), made
by whichever process of the run comes first and read by every other, so that the router, the vLLM workers'
routes other than /health and the dashboard refuse strangers even on loopback without anyone configuring a
token. A multi-host run shares the meet dir (it finds Redis there), so every host reads the same tokens. The
first writer wins without a lock: each candidate writes a complete private file and hard-links it to the final
name, which fails for all but one; a reader therefore never sees a half-written file. A token set in the config
(`router.auth_token`, `rollout.api_key`) wins over the generated one. Nothing here logs a token.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from common.config import Config

SECRETS_FILE = "secrets.json"


class SecretsError(RuntimeError):
    """The meet dir's secrets file is unreadable, malformed or open to other users."""


@dataclass(frozen=True)
class RunSecrets:
    router: str
    """Bearer token of the router's routes but /health (router.auth_token when that is empty)."""
    workers: str
    """Bearer token of every vLLM worker route but /health (rollout.api_key when that is empty)."""
    dash: str
    """The dashboard's token (`slipstream dash`, the launcher's dashboard)."""


def _generate() -> RunSecrets:
    return RunSecrets(
        router=secrets.token_urlsafe(32), workers=secrets.token_urlsafe(32), dash=secrets.token_urlsafe(32)
    )


def read_secrets(meet: Path) -> RunSecrets | None:
    """The run's secrets in meet dir `meet`, or None when it holds none yet."""
    path = Path(meet) / SECRETS_FILE
    try:
        mode = path.stat().st_mode
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise SecretsError(f"cannot read {path}: {exc}") from None
    if stat.S_IMODE(mode) & 0o077:
        raise SecretsError(f"{path} is readable by other users (mode {stat.S_IMODE(mode):o}): chmod 600 {path}")
    names = {f.name for f in fields(RunSecrets)}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SecretsError(f"{path} is not JSON ({exc}); remove it while no process of the run is up") from None
    if not isinstance(data, dict) or set(data) != names or not all(isinstance(v, str) and v for v in data.values()):
        raise SecretsError(
            f"{path} must hold the non-empty strings {sorted(names)}; remove it while no process of the run is up"
        )
    return RunSecrets(**data)


def ensure_secrets(meet: Path) -> RunSecrets:
    """The run's secrets, generated and stored in `meet` by the first caller (see the module docstring)."""
    meet = Path(meet)
    found = read_secrets(meet)
    if found is not None:
        return found
    meet.mkdir(parents=True, exist_ok=True, mode=0o700)
    fresh = _generate()
    candidate = meet / f".{SECRETS_FILE}.{os.getpid()}.{secrets.token_hex(4)}"
    fd = os.open(candidate, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(fresh), f)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(candidate, meet / SECRETS_FILE)
            return fresh
        except FileExistsError:
            pass  # another process of the run was first: its secrets are the run's
    finally:
        with contextlib.suppress(FileNotFoundError):
            candidate.unlink()
    found = read_secrets(meet)
    if found is None:
        raise SecretsError(f"{meet / SECRETS_FILE} vanished right after another process wrote it")
    return found


def apply_secrets(cfg: Config, run: RunSecrets) -> None:
    """Fill the router's and the workers' tokens that the config leaves empty with the run's generated ones."""
    if not cfg.router.auth_token:
        cfg.router.auth_token = run.router
    if not cfg.rollout.api_key:
        cfg.rollout.api_key = run.workers


def locate_meet(path: Path) -> Path:
    """The meet dir holding a run's secrets: `path` itself, or `path`/meet for a run dir (SecretsError if neither)."""
    for candidate in (Path(path), Path(path) / "meet"):
        if (candidate / SECRETS_FILE).is_file():
            return candidate
    raise SecretsError(
        f"no {SECRETS_FILE} in {path} or {Path(path) / 'meet'}: pass the run's meet dir (SLIPSTREAM_MEET_DIR, "
        "rendezvous.meet_dir, by default <run dir>/meet) of a run that has started"
    )


def without_tokens(cfg: Config) -> Config:
    """`cfg` with the router's and the workers' tokens blanked: what a checkpoint may record of it."""
    return replace(cfg, router=replace(cfg.router, auth_token=""), rollout=replace(cfg.rollout, api_key=""))
