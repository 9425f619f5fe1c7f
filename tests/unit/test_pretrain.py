"""Pretraining: JSONL text through a tokenizer, arrays, learning, and metrics with router telemetry."""

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from common.config import Config, ModelConfig
from trainer.data.mixture import RowSampler
from trainer.pretrain import PretrainData, Pretrainer, main, token_rows


@pytest.fixture
def corpus(tmp_path):
    words = ["<eos>", "one", "two", "three", "four", "five", "plus", "is"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    lines = [{"text": "one plus one is two"}, {"text": "two plus two is four"}, {"text": "one plus four is five"}]
    with (tmp_path / "text.jsonl").open("w") as f:
        for i in range(40):
            f.write(json.dumps(lines[i % 3]) + "\n")
    return tmp_path / "text.jsonl", tok_dir


class Recorder:
    def __init__(self):
        self.points = []

    def log(self, tag, step, value):
        self.points.append((tag, step, value))

    def flush(self):
        pass  # points are kept in memory


def test_jsonl_is_tokenized_with_eos_between_documents(corpus):
    text, tok = corpus
    rows = token_rows(PretrainData(str(text), seq_len=8, batch_size=2, tokenizer=str(tok)))
    assert rows.shape[1] == 9
    assert rows[0].tolist() == [1, 6, 1, 7, 2, 0, 2, 6, 2]
    assert (rows[1:, 0] == rows[:-1, -1]).all()  # consecutive rows share one boundary token


def test_two_dimensional_arrays_are_used_as_rows(tmp_path):
    np.save(tmp_path / "rows.npy", np.arange(30).reshape(3, 10))
    assert token_rows(PretrainData(str(tmp_path / "rows.npy"), seq_len=9, batch_size=1)).shape == (3, 10)
    with pytest.raises(ValueError, match="expected seq_len \\+ 1 = 6"):
        token_rows(PretrainData(str(tmp_path / "rows.npy"), seq_len=5, batch_size=1))


def test_sampler_covers_each_row_once_per_epoch():
    sampler = RowSampler(np.arange(10)[:, None], seed=0)
    seen = np.concatenate([sampler.next_batch(3).numpy().ravel() for _ in range(4)])
    assert sorted(seen[:10].tolist()) == list(range(10)) and sampler.cursor() == {"epoch": 1, "position": 2}


@pytest.mark.parametrize("arch", ["deepseek_v3", "mixtral"])
def test_training_lowers_the_loss_and_logs_router_telemetry(corpus, tmp_path, arch):
    text, tok = corpus
    cfg = Config()
    if arch == "mixtral":  # every layer MoE, softmax routing without a bias, GQA without q/k norm
        cfg.trainer.model = ModelConfig(arch="mixtral", first_k_dense=0, n_shared_experts=0)
    cfg.trainer.optim.lr = cfg.trainer.optim.router_lr = cfg.trainer.optim.expert_lr = 3e-3
    recorder = Recorder()
    trainer = Pretrainer(cfg, PretrainData(str(text), 16, 4, str(tok)), tmp_path / "run", recorder)
    losses = trainer.run(25)
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:3])
    tags = {tag for tag, _, _ in recorder.points}
    assert {"train/loss", "train/grad_norm", "train/tokens_per_s"} <= tags
    assert {"router/layer1/load_cv", "router/layer1/entropy"} <= tags
    if arch == "mixtral":  # its first layer is MoE too
        assert {"router/layer0/load_cv", "router/layer0/entropy"} <= tags
    else:
        assert "router/layer1/bias_range" in tags


def test_command_line_writes_metrics_and_a_checkpoint(corpus, tmp_path):
    text, tok = corpus
    cfg_file = tmp_path / "c.toml"
    cfg_file.write_text("[trainer]\nsteps = 2\n")
    run_dir = tmp_path / "cli"
    main(
        [
            str(cfg_file),
            "--data",
            str(text),
            "--tokenizer",
            str(tok),
            "--seq-len",
            "8",
            "--batch-size",
            "2",
            "--run-dir",
            str(run_dir),
        ]
    )
    from common.metrics import read_metrics

    assert {p.tag for p in read_metrics(run_dir)} >= {"train/loss", "router/layer1/load_cv"}
    assert (run_dir / "checkpoints" / "step_00000002" / ".metadata").is_file()
