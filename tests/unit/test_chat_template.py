"""Task prompts through the tokenizer's chat template (rollout.chat_template): the RL generator's prompt ids,
the warm start's rows and the held-out arithmetic evaluation all carry it under "auto" when the tokenizer
has one, and none of them under "off" or without one. The tokenizer is the tiny kit's, built locally, given
the test's own template."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from common.config import Config, load_config
from evaluator.backend import LocalTokenizer
from evaluator.benchmark import load_benchmark
from evaluator.runner import follows_chat_template
from rollout.chat import prompt_token_ids, uses_chat_template
from rollout.generator import SampleGenerator
from rollout.tasks.arithmetic import ArithmeticTask
from trainer.rl.batch import warm_start_batch
from trainer.tinykit import build_tokenizer

DATA = Path(__file__).resolve().parents[2] / "evaluator" / "data"
# The test's template: a system turn first, so its tokens cannot be mistaken for the kit's own template.
TEMPLATE = (
    "<|system|>solve\n{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return path


def tokenizers(path: Path):
    """(templated, untemplated) copies of the tokenizer at `path`."""
    from transformers import AutoTokenizer

    templated, plain = AutoTokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    plain.chat_template = None
    return templated, plain


def test_prompt_ids_carry_the_template_only_when_auto_and_the_tokenizer_has_one(tokenizer_dir):
    tok, plain = tokenizers(tokenizer_dir)
    text = "12+7="
    bare = list(tok(text)["input_ids"])
    templated = prompt_token_ids(tok, text, "auto")
    ids = tok.convert_tokens_to_ids(["<|system|>", "<|user|>", "<|assistant|>"])
    assert templated[0] == ids[0] and templated[-1] == ids[2] and ids[1] in templated
    assert tok.decode(templated) == "<|system|>solve\n<|user|>12+7=\n<|assistant|>"
    assert prompt_token_ids(tok, text, "off") == bare
    assert prompt_token_ids(plain, text, "auto") == bare and not uses_chat_template(plain, "auto")
    with pytest.raises(ValueError, match="rollout.chat_template = 'on'"):
        uses_chat_template(tok, "on")  # type: ignore[arg-type]


def test_the_generator_sends_and_the_warm_start_trains_the_templated_prompt(tokenizer_dir):
    tok, _ = tokenizers(tokenizer_dir)
    task = ArithmeticTask(seed=3, num_problems=50, max_value=6)
    for mode in ("auto", "off"):
        cfg = load_config(None, [f"rollout.chat_template={mode}"])
        generator = SampleGenerator(cfg, None, task, tok)  # type: ignore[arg-type]
        batch, n_targets = warm_start_batch(task, tok, step=0, batch_size=4, chat_template=mode)
        for row in range(4):
            problem = task.problem(len(task) - 1 - row)
            prompt = generator.encode(problem.prompt)
            assert prompt == prompt_token_ids(tok, problem.prompt, mode)
            assert (tok.convert_tokens_to_ids("<|assistant|>") in prompt) == (mode == "auto")
            answer = list(tok(problem.answer, add_special_tokens=False)["input_ids"]) + [tok.eos_token_id]
            # The row is the generator's prompt, then the answer and EOS, every answer token a target.
            tokens = batch["tokens"][row].tolist()
            assert tokens[: len(prompt)] == prompt
            assert tokens[len(prompt) : len(prompt) + len(answer) - 1] == answer[:-1]
            targets = batch["targets"][row]
            assert targets[targets >= 0].tolist() == answer
            assert (targets[: len(prompt) - 1] < 0).all()
        assert n_targets == int((batch["targets"] >= 0).sum())
    assert isinstance(batch["tokens"], torch.Tensor)


def test_the_held_out_evaluation_sends_the_generators_prompt_tokens(tokenizer_dir):
    tok, _ = tokenizers(tokenizer_dir)
    train = load_config(None, ["rollout.task.max_value=6"]).rollout.task
    chat = load_benchmark("arithmetic", DATA, train, chat=True).cases()
    text = load_benchmark("arithmetic", DATA, train).cases()
    assert chat[0].chat and not text[0].chat and chat[0].id == f"{text[0].id}-chat"
    counter = LocalTokenizer(str(tokenizer_dir))
    for c, t in zip(chat[:5], text[:5], strict=True):
        assert isinstance(t.prompt, str)
        # vLLM's chat route renders the served tokenizer's template as the evaluator's counter does.
        n = asyncio.run(counter.count(c))
        assert n == len(prompt_token_ids(tok, t.prompt, "auto")) > len(prompt_token_ids(tok, t.prompt, "off"))


def test_the_evaluator_follows_the_runs_chat_template_setting(tmp_path):
    """The tiny kit's tokenizer has a template: "auto" follows it, "off" (the demo's) does not."""
    cfg = Config()
    assert cfg.rollout.chat_template == "auto"
    assert follows_chat_template(cfg, tmp_path)
    off = load_config(None, ["rollout.chat_template=off"])
    assert not follows_chat_template(off, tmp_path)
    assert load_config(Path(__file__).resolve().parents[2] / "configs" / "demo.toml").rollout.chat_template == "off"
