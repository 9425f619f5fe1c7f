"""`slipstream prep`: JSONL, parquet and `datasets` save_to_disk sources become token shards whose
concatenation is every document followed by eos; a second run tokenizes nothing and leaves every byte and
mtime alone; a shard lost by a killed run is redone alone; bad input names the file and line."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from common.config import Config, DataSourceConfig
from tests.support.text_corpus import documents, expected_stream, word_tokenizer, write_jsonl
from trainer.data.prep import PrepError, cli_main, prep
from trainer.data.shards import read_index, token_dtype

REPO = Path(__file__).resolve().parents[2]


def config(tmp_path: Path, sources: list[DataSourceConfig], shard_mb: float = 0.02) -> Config:
    cfg = Config()
    d = cfg.trainer.data
    d.tokenizer = str(word_tokenizer(tmp_path / "tok"))
    d.root, d.sources, d.shard_mb, d.prep_processes = str(tmp_path / "data"), sources, shard_mb, 2
    return cfg


def stream(source_dir: Path) -> list[int]:
    index = read_index(source_dir)
    assert index is not None and index["complete"]
    return [int(t) for m in index["shards"] for t in np.load(source_dir / m["file"], mmap_mode="r")]


def files_of(root: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.name != ".prep.lock"
    }


def test_jsonl_parquet_and_datasets_directories_become_the_documents_separated_by_eos(tmp_path):
    from datasets import Dataset

    docs = documents(3000, seed=1)
    write_jsonl(tmp_path / "in" / "a.jsonl", docs[:1000])
    pq.write_table(pa.table({"body": docs[1000:2000]}), tmp_path / "in" / "b.parquet", row_group_size=100)
    Dataset.from_dict({"text": docs[2000:]}).save_to_disk(str(tmp_path / "in" / "c"), num_shards=2)
    cfg = config(
        tmp_path,
        [
            DataSourceConfig("a", str(tmp_path / "in" / "a.jsonl")),
            DataSourceConfig("b", str(tmp_path / "in" / "b.parquet"), text_key="body"),
            DataSourceConfig("c", str(tmp_path / "in" / "c")),
        ],
    )
    reports = prep(cfg, progress=False)
    root = tmp_path / "data"
    for name, part in (("a", docs[:1000]), ("b", docs[1000:2000]), ("c", docs[2000:])):
        assert stream(root / name) == expected_stream(part)
        index = read_index(root / name)
        assert index["documents"] == len(part) and index["tokens"] == len(expected_stream(part))
        assert len(index["shards"]) > 1  # small shard_mb: several shards, one stream
        for meta in index["shards"]:
            data = (root / name / meta["file"]).read_bytes()
            assert meta["bytes"] == len(data) and meta["sha256"] == hashlib.sha256(data).hexdigest()
            assert np.load(root / name / meta["file"]).dtype == np.uint16
    assert [r.tokenized for r in reports] == [r.shards for r in reports]


def test_token_files_are_uint16_for_vocabularies_that_fit_and_uint32_above():
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32


def test_a_second_prep_tokenizes_nothing_and_leaves_every_file_byte_identical(tmp_path, capsys):
    write_jsonl(tmp_path / "in" / "web.jsonl", documents(2000, seed=2))
    cfg = config(tmp_path, [DataSourceConfig("web", str(tmp_path / "in" / "web.jsonl"))])
    first = prep(cfg, progress=False)[0]
    assert first.tokenized == first.shards > 2
    before = files_of(tmp_path / "data")
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text(
        f'[trainer.data]\nroot = "{tmp_path / "data"}"\ntokenizer = "{tmp_path / "tok"}"\nshard_mb = 0.02\n'
        f'[[trainer.data.sources]]\nname = "web"\npath = "{tmp_path / "in" / "web.jsonl"}"\n'
    )
    assert cli_main([str(cfg_file), "--no-progress"]) == 0
    assert f"web: {first.shards} shards (0 tokenized, {first.shards} already done)" in capsys.readouterr().out
    assert files_of(tmp_path / "data") == before  # bytes and mtimes: nothing was rewritten


def test_a_shard_lost_by_a_killed_prep_is_redone_and_nothing_else(tmp_path):
    write_jsonl(tmp_path / "in" / "web.jsonl", documents(2000, seed=3))
    cfg = config(tmp_path, [DataSourceConfig("web", str(tmp_path / "in" / "web.jsonl"))])
    prep(cfg, progress=False)
    src = tmp_path / "data" / "web"
    good = (src / "shard-00001.npy").read_bytes()
    # What a kill leaves: an index that does not list the shard yet, a half-written shard under its final
    # name from before the kill (a rename never leaves one, but a full disk might), and a temporary file.
    index = json.loads((src / "index.json").read_text())
    index["shards"][1], index["complete"] = None, False
    (src / "index.json").write_text(json.dumps(index))
    (src / "shard-00001.npy").write_bytes(good[: len(good) // 2])
    (src / ".shard-00002.npy.999.tmp").write_bytes(b"partial")
    report = prep(cfg, progress=False)[0]
    assert report.tokenized == 1
    assert (src / "shard-00001.npy").read_bytes() == good
    assert not list(src.glob(".*.tmp")) and read_index(src)["complete"]


def test_a_changed_input_is_prepped_again(tmp_path):
    path = write_jsonl(tmp_path / "in" / "web.jsonl", documents(500, seed=4))
    cfg = config(tmp_path, [DataSourceConfig("web", str(path))])
    prep(cfg, progress=False)
    docs = documents(400, seed=5)
    write_jsonl(path, docs)
    report = prep(cfg, progress=False)[0]
    assert report.tokenized == report.shards and stream(tmp_path / "data" / "web") == expected_stream(docs)


def test_a_malformed_jsonl_line_is_named_by_file_and_line(tmp_path):
    path = tmp_path / "in" / "web.jsonl"
    lines = [json.dumps({"text": d}) for d in documents(1500, seed=6)]
    lines[1234] = '{"text": "w1 w2'  # far into a later shard: the line number counts the shards before it
    path.parent.mkdir()
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(PrepError, match=f"{path}:1235: not a JSON object"):
        prep(config(tmp_path, [DataSourceConfig("web", str(path))]), progress=False)
    lines[1234] = json.dumps({"body": "w1"})
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(
        PrepError, match=rf"{path}:1235: no string field 'text'; set trainer.data.sources\[0\].text_key"
    ):
        prep(config(tmp_path, [DataSourceConfig("web", str(path))]), progress=False)


def test_a_missing_parquet_column_names_the_config_key(tmp_path):
    pq.write_table(pa.table({"body": ["w1 w2"]}), tmp_path / "b.parquet")
    cfg = config(tmp_path, [DataSourceConfig("a", str(tmp_path / "b.parquet"))])
    with pytest.raises(PrepError, match=r"no column 'text' \(columns: body\); set trainer.data.sources\[0\].text_key"):
        prep(cfg, progress=False)


def test_slipstream_prep_has_help_and_refuses_a_config_without_sources(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "common.runs.cli", "prep", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "trainer.data.sources" in out
    (tmp_path / "c.toml").write_text("[trainer]\nsteps = 1\n")
    done = subprocess.run(
        [sys.executable, "-m", "common.runs.cli", "prep", str(tmp_path / "c.toml")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "add [[trainer.data.sources]] tables" in done.stderr
