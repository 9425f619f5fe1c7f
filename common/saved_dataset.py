"""A `datasets` `Dataset.save_to_disk` directory read without the `datasets` library: its state.json lists
its arrow files (IPC streams) in order. RL prompt sources (rollout/tasks/sources.py) and pretraining data
prep (trainer/data) both read users' saved datasets through here."""

from __future__ import annotations

import json
from pathlib import Path

STATE = "state.json"


def is_saved_dataset(path: Path) -> bool:
    return (path / STATE).is_file()


def saved_dataset_files(path: Path) -> list[Path]:
    """The arrow files of a saved dataset, in its order. A saved DatasetDict (several splits) or a directory
    without state.json is an error naming the fix."""
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        raise ValueError(
            f"{path} is a saved DatasetDict (splits {', '.join(splits)}); point the path at one split, "
            f"e.g. {path / (splits[0] if splits else 'train')}"
        )
    if not is_saved_dataset(path):
        raise ValueError(
            f"{path} is not a Dataset.save_to_disk directory (no {STATE}); give such a directory, "
            "or a .jsonl/.parquet file"
        )
    return [path / entry["filename"] for entry in json.loads((path / STATE).read_text())["_data_files"]]
