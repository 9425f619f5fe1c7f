"""The evaluator's result cache: one JSONL file of finished generations keyed by a fingerprint of
(weight version, served model, case id, prompt, sampling, samples), so an interrupted evaluation resumes
without regenerating what it already has, and a new weight version never reuses an old answer.
Each record is appended as one line with a single write and flushed at once; a process killed in the
middle of a write leaves at most a truncated last line, which is dropped (and logged) on load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

from evaluator.benchmark import Case

log = logging.getLogger(__name__)


def fingerprint(version: str | None, model: str, case: Case) -> str:
    """The cache key of a case's generation under one weight version of one served model."""
    blob = json.dumps(
        {
            "version": version,
            "model": model,
            # Two cases with the same prompt stay independent draws (and keep their own samples).
            "case": case.id,
            "prompt": case.prompt_json(),
            "sampling": case.sampling.request_fields(),
            "samples": case.samples,
        },
        sort_keys=True,
        ensure_ascii=False,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


class ResultCache:
    """Append-only JSONL of {key, ...record}; loaded fully at open (eval sets are small)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.records: dict[str, dict[str, Any]] = {}
        if self.path.exists():
            self._load()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _load(self) -> None:
        data = self.path.read_bytes()
        lines = data.split(b"\n")
        for i, raw in enumerate(lines):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
                self.records[record["key"]] = record
            except (ValueError, KeyError, TypeError):
                if i == len(lines) - 1:
                    # A torn final write: cut it off so the next record starts a clean line.
                    log.warning("dropping a truncated last line of %s (a write was interrupted)", self.path)
                    os.truncate(self.path, len(data) - len(raw))
                    continue
                raise ValueError(
                    f"{self.path}:{i + 1} is not a cache record; delete the file to start afresh"
                ) from None
        if self.path.stat().st_size and not self.path.read_bytes().endswith(b"\n"):
            # A complete last record whose newline was never written: end its line.
            with self.path.open("ab") as fh:
                fh.write(b"\n")

    def get(self, key: str) -> dict[str, Any] | None:
        return self.records.get(key)

    def put(self, key: str, record: dict[str, Any]) -> None:
        full = {"key": key, **record}
        os.write(self._fd, (json.dumps(full, ensure_ascii=False) + "\n").encode())
        self.records[key] = full

    def __len__(self) -> int:
        return len(self.records)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> ResultCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
