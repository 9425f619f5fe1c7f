"""The pretraining mixture: sources drawn in proportion to weight ** (1 / temperature), rows packed as
token_rows packs them, a resume from the cursor continues the very stream, and a W = 2 run checkpointed
mid-way and resumed at W = 1 trains what an uninterrupted W = 1 run trains."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import numpy as np
import pytest
from test_trainer_ranks import MODEL, launch, losses

from common.config import Config, ConfigError, DataSourceConfig, from_dict, identity_diff, load_config, to_toml
from tests.support.text_corpus import documents, word_tokenizer, write_jsonl
from trainer.data.mixture import Mixture, effective_probabilities
from trainer.data.prep import prep
from trainer.data.shards import NotPrepped, ShardRows
from trainer.pretrain import PretrainData, Pretrainer, open_rows, token_rows


def test_effective_probabilities_are_weights_to_the_inverse_temperature_normalised():
    p = effective_probabilities([0.6, 0.3, 0.1], [1.0, 2.0, 0.5])
    raw = np.array([0.6, 0.3**0.5, 0.1**2])
    np.testing.assert_allclose(p, raw / raw.sum())
    np.testing.assert_allclose(effective_probabilities([2, 6], [1, 1]), [0.25, 0.75])


def test_sources_are_drawn_within_2_percent_of_their_effective_share_over_1e5_tokens():
    seq_len = 8
    sizes = [50, 500, 5000]  # rows; the small sources go through many epochs
    sources = [(f"s{i}", np.full((n, seq_len + 1), i, dtype=np.int64)) for i, n in enumerate(sizes)]
    p = effective_probabilities([0.5, 0.3, 0.2], [1.0, 2.0, 1.0])
    mix = Mixture(sources, p, seed=7)
    rows = np.concatenate([mix.next_rows(25) for _ in range(100_000 // (25 * seq_len))])
    tokens = rows[:, 1:].ravel()
    share = np.bincount(tokens, minlength=3) / len(tokens)
    assert len(tokens) == 100_000
    assert np.abs(share - p).max() < 0.02, (share, p)


def test_prepped_rows_are_cut_from_the_stream_exactly_as_token_rows_cuts_it(tmp_path):
    shards = [np.arange(0, 37), np.arange(37, 40), np.arange(40, 101)]  # rows straddle both boundaries
    np.save(tmp_path / "stream.npy", np.concatenate(shards))
    expected = token_rows(PretrainData(str(tmp_path / "stream.npy"), seq_len=6, batch_size=1))
    rows = ShardRows([s.astype(np.uint16) for s in shards], seq_len=6, label="test")
    assert len(rows) == len(expected)
    np.testing.assert_array_equal(rows[np.arange(len(rows))], expected)


def mixture_config(tmp_path: Path) -> Config:
    """Two prepped JSONL sources (web: 600 documents, code: 60; the second at temperature 2)."""
    web = write_jsonl(tmp_path / "in" / "web.jsonl", documents(600, seed=1, words=range(1, 21)))
    code = write_jsonl(tmp_path / "in" / "code.jsonl", documents(60, seed=2, words=range(21, 41)))
    text = f"""
[trainer.data]
root = "{tmp_path / "data"}"
tokenizer = "{word_tokenizer(tmp_path / "tok")}"
seq_len = 16
batch_size = 8
shard_mb = 0.01
prep_processes = 1

[[trainer.data.sources]]
name = "web"
path = "{web}"
weight = 0.7

[[trainer.data.sources]]
name = "code"
path = "{code}"
weight = 0.3
temperature = 2.0
"""
    return from_dict(tomllib.loads(text))


def data_of(cfg: Config) -> PretrainData:
    d = cfg.trainer.data
    return PretrainData("", d.seq_len, d.batch_size, d.tokenizer, sources=d.sources, root=d.root)


def test_a_restored_cursor_continues_the_same_stream_in_a_fresh_loader(tmp_path):
    cfg = mixture_config(tmp_path)
    prep(cfg, progress=False)
    straight = open_rows(data_of(cfg), seed=3)
    first = open_rows(data_of(cfg), seed=3)
    for _ in range(40):  # past the end of an epoch of the small source
        first.next_rows(8)
    cursor = json.loads(json.dumps(first.cursor()))  # it travels through a checkpoint
    assert cursor["rows"] == 320 and cursor["sources"]["code"]["epoch"] >= 1
    resumed = open_rows(data_of(cfg), seed=3)
    resumed.restore(cursor)
    whole = np.concatenate([straight.next_rows(8) for _ in range(70)])
    rest = np.concatenate([resumed.next_rows(8) for _ in range(30)])
    np.testing.assert_array_equal(rest, whole[320:])
    assert (whole[:, 1:] <= 20).any() and (whole[:, 1:] > 20).any()  # both sources are in the stream


def test_a_source_that_is_not_prepped_or_changed_since_names_slipstream_prep(tmp_path):
    cfg = mixture_config(tmp_path)
    with pytest.raises(NotPrepped, match=r"trainer.data.sources\[0\] \('web'\) is not prepped.*slipstream prep CONFIG"):
        open_rows(data_of(cfg), seed=0)
    prep(cfg, progress=False)
    write_jsonl(tmp_path / "in" / "code.jsonl", documents(10, seed=9))
    with pytest.raises(NotPrepped, match=r"sources\[1\] \('code'\): the inputs .* changed .*slipstream prep CONFIG"):
        open_rows(data_of(cfg), seed=0)


def test_sources_are_a_list_of_tables_that_round_trips_and_belongs_to_the_identity(tmp_path):
    cfg = mixture_config(tmp_path)
    assert [s.name for s in cfg.trainer.data.sources] == ["web", "code"]
    assert from_dict(tomllib.loads(to_toml(cfg))) == cfg
    other = from_dict(tomllib.loads(to_toml(cfg)))
    other.trainer.data.sources[1].weight = 0.5
    assert identity_diff(cfg, other) == ["trainer.data.sources"]
    for bad, message in [
        ({"sources": [{"name": "a", "path": "x"}, {"name": "a", "path": "y"}]}, "names must be unique"),
        ({"sources": [{"name": "a", "path": "x", "temperature": 0.0}]}, r"sources\[0\].temperature = 0.0 must be > 0"),
        ({"sources": [{"name": "a/b", "path": "x"}]}, "it names a directory"),
        ({"sources": [{"name": "a", "path": "x"}], "path": "t.npy"}, "both set"),
    ]:
        with pytest.raises(ConfigError, match=message):
            from_dict({"trainer": {"data": bad}})
    assert DataSourceConfig().temperature == 1.0


def run_config(tmp_path: Path, cfg: Config, name: str, world: int, steps: int, run_dir: Path) -> Path:
    """A launcher config pretraining on cfg's prepped mixture with `world` trainer ranks (EP = world)."""
    d = cfg.trainer.data
    sources = "".join(
        f'[[trainer.data.sources]]\nname = "{s.name}"\npath = "{s.path}"\nweight = {s.weight}\n'
        f"temperature = {s.temperature}\n"
        for s in d.sources
    )
    path = tmp_path / f"{name}.toml"
    path.write_text(f"""
[run]
name = "{name}"
root = "{tmp_path / "runs"}"
dir = "{run_dir}"

[trainer]
mode = "pretrain"
steps = {steps}
device = "cpu"

[trainer.data]
root = "{d.root}"
tokenizer = "{d.tokenizer}"
seq_len = {d.seq_len}
batch_size = {d.batch_size}

{sources}
[trainer.parallel]
ep = {world}

[trainer.optim]
grad_accum = 2
lr = 3e-3
router_lr = 3e-3
expert_lr = 3e-3
{MODEL}
[launch]
stop_timeout_s = 5.0

[launch.roles.trainer]
replicas = {world}
critical = true
""")
    return path


def test_a_two_rank_run_resumed_on_one_rank_trains_what_one_uninterrupted_rank_trains(tmp_path):
    cfg = mixture_config(tmp_path)
    prep(cfg, progress=False)
    steps = 6
    run_dir = tmp_path / "runs" / "split"
    code, out = launch(run_config(tmp_path, cfg, "mix2", 2, steps // 2, run_dir), "mix-w2")
    assert code == 0, out
    resume = run_config(tmp_path, cfg, "mix1", 1, steps, run_dir)
    code, out = launch(resume, "mix-w1")
    assert code == 0, out
    assert f"at step {steps // 2}" in out
    # The uninterrupted reference: one rank, in this process.
    ref_cfg = load_config(resume)
    reference = Pretrainer(ref_cfg, data_of(ref_cfg), tmp_path / "straight").run(steps)
    got = losses(run_dir)
    assert len(got) == len(reference) == steps
    np.testing.assert_allclose(got, reference, rtol=1e-5, atol=0)
