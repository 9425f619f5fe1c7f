"""The git revision of the checkout the code runs from, for the run registry and the metric sinks."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent.parent


def git_sha(repo_dir: str | Path = SOURCE_DIR) -> tuple[str, bool | None]:
    """(sha, dirty) of the checkout at repo_dir; ("unknown", None) with the reason logged when unreadable."""
    try:
        sha = subprocess.run(
            ["git", "-C", str(repo_dir), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("git sha unknown: cannot run git in %s: %s", repo_dir, exc)
        return "unknown", None
    if sha.returncode != 0:
        log.warning("git sha unknown: %s is not a git checkout with commits: %s", repo_dir, sha.stderr.strip())
        return "unknown", None
    status = subprocess.run(
        ["git", "-C", str(repo_dir), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
        timeout=10,
    )
    return sha.stdout.strip(), bool(status.stdout.strip()) if status.returncode == 0 else None
