"""The run registry: one SQLite row per run (id, name, config TOML, git sha, status, start, end).

It lives at `<run.root>/registry.sqlite`, next to the run directories. The git sha is read from
the checkout the code runs from (common.gitinfo); where that is impossible it is "unknown" and the reason is
logged.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from common.gitinfo import SOURCE_DIR, git_sha

STATUSES = ("running", "succeeded", "failed", "interrupted")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs(
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    config TEXT NOT NULL,
    git_sha TEXT NOT NULL,
    git_dirty INTEGER,
    status TEXT NOT NULL,
    started_at REAL NOT NULL,
    ended_at REAL
)
"""


@dataclass(frozen=True)
class RunRecord:
    id: str
    name: str
    config: str
    git_sha: str
    git_dirty: bool | None
    status: str
    started_at: float
    ended_at: float | None


class Registry:
    """Access to one registry file; safe for several processes (SQLite WAL, busy timeout)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as con:
            con.execute("PRAGMA journal_mode=WAL")
            con.execute(_SCHEMA)

    @classmethod
    def for_root(cls, root: str | Path) -> Registry:
        return cls(Path(root) / "registry.sqlite")

    @contextlib.contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        con = sqlite3.connect(self.path, timeout=30)
        try:
            with con:  # commits, or rolls back on error
                yield con
        finally:
            con.close()

    def start(self, run_id: str, name: str, config_toml: str, repo_dir: str | Path = SOURCE_DIR) -> RunRecord:
        """Insert the row of a new run (status running); a run id that exists is an error."""
        sha, dirty = git_sha(repo_dir)
        try:
            with self._connect() as con:
                con.execute(
                    "INSERT INTO runs VALUES (?, ?, ?, ?, ?, 'running', ?, NULL)",
                    (run_id, name, config_toml, sha, None if dirty is None else int(dirty), time.time()),
                )
        except sqlite3.IntegrityError:
            raise ValueError(f"run id {run_id!r} is already in {self.path}; choose another SLIPSTREAM_EXP") from None
        return self.get(run_id)

    def resume(self, run_id: str, config_toml: str) -> RunRecord:
        """Mark a run that exists running again (a relaunch continues it); its config becomes `config_toml`."""
        with self._connect() as con:
            cur = con.execute(
                "UPDATE runs SET status = 'running', ended_at = NULL, config = ? WHERE id = ?", (config_toml, run_id)
            )
        if cur.rowcount != 1:
            raise KeyError(f"run id {run_id!r} is not in {self.path}; it cannot be resumed")
        return self.get(run_id)

    def finish(self, run_id: str, status: str) -> None:
        if status not in STATUSES:
            raise ValueError(f"run status {status!r} is not one of {STATUSES}")
        with self._connect() as con:
            cur = con.execute("UPDATE runs SET status = ?, ended_at = ? WHERE id = ?", (status, time.time(), run_id))
        if cur.rowcount != 1:
            raise KeyError(f"run id {run_id!r} is not in {self.path}")

    def get(self, run_id: str) -> RunRecord:
        with self._connect() as con:
            row = con.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
        if row is None:
            raise KeyError(f"run id {run_id!r} is not in {self.path}")
        row = list(row)
        row[4] = None if row[4] is None else bool(row[4])
        return RunRecord(*row)

    def list(self) -> list[RunRecord]:
        with self._connect() as con:
            ids = [r[0] for r in con.execute("SELECT id FROM runs ORDER BY started_at")]
        return [self.get(i) for i in ids]
