"""Prompt files: JSONL, parquet, and `datasets` save_to_disk directories, read into problems.

Every format gives the same problems for the same records: the prompt and answer columns named by the
config (an answer may be a number; it is compared as text or numerically by the verifier), and the id
column when a row has one, else `<file stem>-<line or row number>`. A bad record is an error naming the
file with its line (JSONL) or row (parquet, arrow) and the key to fix. A `datasets` directory is read
with pyarrow's IPC stream reader through its state.json, so the product never imports `datasets`.
Left out: streaming reads. A prompt set is loaded whole, which RL prompt sets (thousands to a few
million short prompts) afford.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.jsonl import read_jsonl
from common.saved_dataset import saved_dataset_files
from rollout.tasks import Problem


@dataclass(frozen=True)
class RecordKeys:
    """Where a record keeps its prompt, answer and (optional) id."""

    prompt: str = "prompt"
    answer: str = "answer"
    id: str = "id"


def read_problems(
    path: str | Path,
    fmt: str,
    keys: RecordKeys = RecordKeys(),
    config_key: str = "rollout.task",
    source: str = "",
) -> list[Problem]:
    """The problems of one prompt file (fmt: jsonl, parquet or datasets), in file order.

    `config_key` is the config table the path came from (errors name `<config_key>.path` and its keys);
    a non-empty `source` prefixes every id (`source/id`) and is stored on each problem.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(
            f"{config_key}.path {str(path)!r} does not exist; give a JSONL or parquet file of "
            f"{keys.prompt!r}/{keys.answer!r} records, or a Dataset.save_to_disk directory"
        )
    if fmt == "jsonl":
        records = _jsonl_records(path, keys)
        what = "a JSON object"
    elif fmt in ("parquet", "datasets"):
        records = _table_records(
            path, _read_parquet(path) if fmt == "parquet" else _read_saved_dataset(path), keys, config_key
        )
        what = "a row"
    else:
        raise ValueError(f"{config_key}: unknown prompt file format {fmt!r}; use jsonl, parquet or datasets")
    problems = []
    for where, number, record in records:
        try:
            prompt, answer = record[keys.prompt], record[keys.answer]
            if not isinstance(prompt, str) or not prompt:
                raise TypeError(f"{keys.prompt!r} is {prompt!r}, not a non-empty string")
            if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
                raise TypeError(f"{keys.answer!r} is {answer!r}, not a string or a number")
        except (KeyError, TypeError) as exc:
            raise ValueError(
                f"{where}: expected {what} with {keys.prompt!r} and {keys.answer!r} ({exc}); fix the record or "
                f"set {config_key}.prompt_key / answer_key to the file's names"
            ) from None
        raw_id = record.get(keys.id)
        name = str(raw_id) if raw_id is not None else f"{path.stem}-{number}"
        problems.append(Problem(f"{source}/{name}" if source else name, prompt, str(answer), source))
    if not problems:
        raise ValueError(f"{config_key}.path {str(path)!r} holds no problems")
    return problems


def _jsonl_records(path: Path, keys: RecordKeys) -> Iterator[tuple[str, int, Mapping[str, Any]]]:
    """(file:line, line number, record) of every non-blank line."""
    for lineno, record in read_jsonl(path, f"a JSON object with {keys.prompt!r} and {keys.answer!r}"):
        yield f"{path}:{lineno}", lineno, record


def _read_parquet(path: Path) -> Any:
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path)
    except Exception as exc:  # pyarrow raises its own ArrowInvalid/OSError family for a non-parquet file
        raise ValueError(f"{path}: not a readable parquet file ({exc})") from None


def _read_saved_dataset(path: Path) -> Any:
    """The table of a `Dataset.save_to_disk` directory: its arrow files, in state.json's order."""
    import pyarrow as pa

    tables = []
    for file in saved_dataset_files(path):
        try:
            with pa.memory_map(str(file)) as stream:
                tables.append(pa.ipc.open_stream(stream).read_all())
        except (OSError, pa.ArrowInvalid) as exc:
            raise ValueError(f"{file}: unreadable arrow stream of the saved dataset {path} ({exc})") from None
    if not tables:
        raise ValueError(f"{path} holds no problems (state.json lists no data files)")
    return pa.concat_tables(tables)


def _table_records(
    path: Path, table: Any, keys: RecordKeys, config_key: str
) -> Iterator[tuple[str, int, Mapping[str, Any]]]:
    """(file row N, row number, record) of every row of an arrow table (rows numbered from 0)."""
    for key, name in ((keys.prompt, "prompt_key"), (keys.answer, "answer_key")):
        if key not in table.column_names:
            raise ValueError(
                f"{path}: no column {key!r} (columns: {', '.join(table.column_names)}); set {config_key}.{name}"
            )
    names = [k for k in (keys.prompt, keys.answer, keys.id) if k in table.column_names]
    columns = [table.column(k).to_pylist() for k in names]
    for row, values in enumerate(zip(*columns, strict=True)):
        yield f"{path} row {row}", row, dict(zip(names, values, strict=True))
