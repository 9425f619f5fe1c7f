"""The tokenizer and chat template travel (common/weights/model_files.py): a version published from a run
whose model is an HF directory carries its config.json, generation config, tokenizer and chat template, so
the version directory is a whole HF model (transformers loads it, with logits equal to the original's), a
republished version carries them too, and `slipstream eval --version N` reads the version's tokenizer and
chat template."""

import asyncio
import json
from pathlib import Path

import pytest
import torch

from common.config import load_config
from common.weights.file import FileTransport
from common.weights.model_files import MODEL_FILES, copy_model_files, tokenizer_dir
from common.weights.versions import version_dir, weight_root
from evaluator.cli import build_parser, version_tokenizer
from evaluator.runner import follows_chat_template
from tests.support.hf_dirs import tiny_qwen3_dir
from trainer.hf import hf_tensors, import_hf
from trainer.tinykit import CHAT_TEMPLATE

transformers = pytest.importorskip("transformers")

CARRIED = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    return tiny_qwen3_dir(tmp_path_factory.mktemp("qwen3"))


def _publish(root: Path, model_dir: Path, version: int, source: int | None = None) -> Path:
    """Publish through the file transport to no worker: write (or republish) and commit one version."""
    transport = FileTransport(
        root, driver=None, shard_bytes=1 << 16, stream=True, keep_versions=10, model_files=model_dir
    )  # type: ignore[arg-type]

    async def go() -> str:
        if source is None:
            tensors = {n: t.detach().clone() for n, t in hf_tensors(import_hf(model_dir))}
            await transport.prepare(version, tensors)
        else:
            await transport.prepare_copy(version, source)
        result = await transport.send(version, {}, "abort")
        await transport.finish(True)
        return result.location

    return Path(asyncio.run(go()))


def test_published_versions_are_whole_hf_models(qwen3_dir, tmp_path):
    v1 = _publish(tmp_path, qwen3_dir, 1)
    for name in CARRIED:
        assert (v1 / name).read_bytes() == (qwen3_dir / name).read_bytes(), name
    assert len(list(v1.glob("model-*.safetensors"))) > 1  # a sharded version, not one file
    tok = transformers.AutoTokenizer.from_pretrained(v1)
    assert tok.chat_template == CHAT_TEMPLATE
    tokens = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        original = transformers.AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32)(tokens).logits
        published = transformers.AutoModelForCausalLM.from_pretrained(v1, dtype=torch.float32)(tokens).logits
    assert torch.equal(original, published)
    v2 = _publish(tmp_path, qwen3_dir, 2, source=1)  # a republish links every file of the source version
    assert sorted(p.name for p in v2.iterdir()) == sorted(p.name for p in v1.iterdir())


def test_copy_model_files_copies_what_is_there(qwen3_dir, tmp_path):
    assert copy_model_files(qwen3_dir, tmp_path / "out") == [n for n in MODEL_FILES if n in CARRIED]
    assert tokenizer_dir(tmp_path / "out") == tmp_path / "out"
    assert tokenizer_dir(tmp_path) is None


def test_eval_of_a_version_reads_its_tokenizer_and_chat_template(qwen3_dir, tmp_path):
    run = tmp_path / "run"
    cfg = load_config(None, [f"rollout.model={qwen3_dir}", "rollout.chat_template=auto"])
    root = weight_root(cfg.rollout, run)
    _publish(root, qwen3_dir, 3)
    # A version without a chat template (as if the model had none) and one with: the version decides.
    plain = version_dir(root, 4)
    plain.mkdir()
    copy_model_files(qwen3_dir, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    for version, chat in ((3, True), (4, False)):
        args = build_parser().parse_args(["--run-dir", str(run), "--version", str(version)])
        found = version_tokenizer(args, cfg, run)
        assert found == version_dir(root, version)
        assert follows_chat_template(cfg, run, found) is chat
