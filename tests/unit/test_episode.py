"""Episodes (rollout/episode.py, rollout/tools/env.py): trajectories kept as tokens across turns, masks for what the
policy did not write, the budget, and tools that fail or run away. The tokenizer is the tiny kit's, built here; the
environments, the calculator and the sandboxed python tool are the real ones. The policy is a scripted stand-in for
vLLM's token-in/token-out route (a function returning the `Sample` the route's answer parses to): the tiny model
cannot be made to write a chosen tool call, least of all a runaway program; the real route is played by the
launched tool demo (tests/e2e/test_rl_e2e.py)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

import pytest
import torch

from common.config import EpisodeConfig
from rollout.chat import prompt_token_ids, turn_ids
from rollout.client import Sample
from rollout.episode import Budget, TaskEnvironments, run_episode
from rollout.tasks import Problem
from rollout.tasks.arithmetic import ArithmeticTask
from rollout.tools.env import ToolEnvironments, calculate, call_text
from trainer.rl.batch import padded_batch, warm_start_batch
from trainer.tinykit import build_tokenizer

PROBLEM = Problem("p-1", "37*48+19=", "1795")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("tok")
    build_tokenizer(out)
    return AutoTokenizer.from_pretrained(out)


class ScriptedPolicy:
    """Answers turn k with the k-th text (EOS after it), each token at version `version + k`, log-prob -0.5 - k;
    records every context it was sent."""

    def __init__(self, tok, texts: list[str], version: int = 3) -> None:
        self.tok, self.texts, self.version = tok, texts, version
        self.contexts: list[list[int]] = []

    async def __call__(self, context: list[int], max_tokens: int) -> Sample:
        k = len(self.contexts)
        self.contexts.append(list(context))
        ids = self.tok(self.texts[k], add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        ids = ids[:max_tokens]
        n = len(ids)
        return Sample(list(context), ids, [-0.5 - k] * n, [self.version + k] * n, "stop")


def tools_env(tmp_path: Path, **changes) -> ToolEnvironments:
    cfg = EpisodeConfig(environment="tools", **changes)
    return ToolEnvironments.from_config(cfg, ArithmeticTask(), tmp_path)


BUDGET = Budget(max_turns=4, max_tokens=240, turn_tokens=128, max_model_len=256)


async def test_a_tool_episode_keeps_every_sampled_and_appended_id_with_masks_versions_and_log_probs(tok, tmp_path):
    call = call_text("calculator", {"expression": "37*48+19"})
    policy = ScriptedPolicy(tok, [call, "1795"])
    envs = tools_env(tmp_path)
    ep = await run_episode(envs.new(), PROBLEM, policy, tok, "off", BUDGET)
    prompt = prompt_token_ids(tok, PROBLEM.prompt, "off")
    first = tok(call, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    observation = turn_ids(tok, "<tool_response>\n1795\n</tool_response>", "off")
    answer = tok("1795", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    # The second turn was sent exactly the ids before it: nothing re-tokenized.
    assert policy.contexts == [prompt, prompt + first + observation]
    s = ep.sample
    assert s.prompt_token_ids == prompt and s.token_ids == first + observation + answer
    assert s.mask == [1] * len(first) + [0] * len(observation) + [1] * len(answer)
    assert s.versions == [3] * len(first) + [3] * len(observation) + [4] * len(answer)
    assert s.logprobs == [-0.5] * len(first) + [0.0] * len(observation) + [-1.5] * len(answer)
    assert (ep.reward, ep.policy_turns, ep.tool_calls, ep.ended, ep.text) == (1.0, 2, 1, "done", "1795")
    assert [t.by for t in ep.turns] == ["policy", "env", "policy"]
    # The trainer's row is these ids; only the policy's are targets.
    from rollout.generator import Rollout

    tokens, targets, behaviour, trained = padded_batch([Rollout(s, ep.reward, ep.text)], tok.pad_token_id)
    assert tokens[0].tolist() == prompt + first + observation + answer
    p = len(prompt)
    expected = [-1] * (p - 1) + [t if m else -1 for t, m in zip(s.token_ids, s.mask, strict=True)] + [-1]
    assert targets[0].tolist() == expected
    assert int(trained.sum()) == len(first) + len(answer)


async def test_a_single_turn_task_is_a_one_step_episode_with_no_mask(tok):
    task = ArithmeticTask()
    problem = task.problem(0)
    policy = ScriptedPolicy(tok, [problem.answer])
    ep = await run_episode(TaskEnvironments(task).new(), problem, policy, tok, "off", BUDGET)
    assert ep.sample.mask is None and ep.reward == 1.0 and ep.policy_turns == 1 and ep.ended == "done"
    assert ep.sample.prompt_token_ids == prompt_token_ids(tok, problem.prompt, "off")


async def test_a_malformed_call_and_an_unknown_tool_are_observations_and_the_episode_goes_on(tok, tmp_path):
    policy = ScriptedPolicy(tok, ["<tool_call>{nope</tool_call>", call_text("abacus", {}), "1795"])
    ep = await run_episode(tools_env(tmp_path).new(), PROBLEM, policy, tok, "off", BUDGET)
    texts = [t.text for t in ep.turns if t.by == "env"]
    assert "tool call is not valid JSON" in texts[0] and "unknown tool 'abacus'; tools: calculator" in texts[1]
    assert (ep.reward, ep.policy_turns, ep.tool_calls) == (1.0, 3, 2)


async def test_the_budget_ends_an_episode_after_max_turns_and_bounds_each_turn_by_the_tokens_left(tok, tmp_path):
    call = call_text("calculator", {"expression": "1+1"})
    policy = ScriptedPolicy(tok, [call] * 5)
    ep = await run_episode(
        tools_env(tmp_path).new(), PROBLEM, policy, tok, "off", dataclasses.replace(BUDGET, max_turns=2)
    )
    assert (ep.policy_turns, ep.ended, ep.reward) == (2, "max_turns", 0.0)
    # The observation after the last turn is kept in the record but not in the trained sample.
    assert ep.turns[-1].by == "env" and ep.sample.mask is not None and ep.sample.mask[-1] == 1
    tight = Budget(max_turns=4, max_tokens=40, turn_tokens=128, max_model_len=256)
    ep = await run_episode(tools_env(tmp_path).new(), PROBLEM, ScriptedPolicy(tok, [call] * 5), tok, "off", tight)
    assert ep.ended == "max_tokens" and len(ep.sample.token_ids) <= 40


@pytest.mark.parametrize(
    ("code", "limit"),
    [
        # One line each: the tiny vocabulary has no backslash, so a JSON string cannot hold a newline.
        ("while True: pass", "cpu time limit 1s exceeded"),
        ("x = bytearray(1 << 30)", "memory limit 128 MiB exceeded"),
        ("import socket; socket.create_connection(('192.0.2.1', 80), timeout=20)", "network access attempted"),
        ("import socket; socket.getaddrinfo('example.com', 80)", "network access attempted"),
    ],
    ids=["loops", "allocates", "connects", "resolves"],
)
async def test_a_runaway_python_call_is_stopped_within_its_limits_and_ends_the_episode_alone(
    tok, tmp_path, code, limit
):
    """Beside the runaway episode, calculator episodes run at once and finish right: nothing else is touched."""
    envs = tools_env(tmp_path, tools=["python", "calculator"], python_cpu_s=1, python_wall_s=3.0, python_memory_mb=128)
    runaway = ScriptedPolicy(tok, [call_text("python", {"code": code}), "1795"])
    others = [ScriptedPolicy(tok, [call_text("calculator", {"expression": "37*48+19"}), "1795"]) for _ in range(4)]
    t0 = time.monotonic()
    bad, *good = await asyncio.gather(
        run_episode(envs.new(), PROBLEM, runaway, tok, "off", BUDGET),
        *(run_episode(envs.new(), PROBLEM, p, tok, "off", BUDGET) for p in others),
    )
    took = time.monotonic() - t0
    assert bad.ended == "done" and bad.policy_turns == 1 and bad.reward == 0.0 and bad.tool_errors == 1
    assert bad.turns[-1].by == "env" and limit in bad.turns[-1].text
    assert len(runaway.contexts) == 1  # the policy was not asked again
    assert took < 3.0 + 2.0, f"the runaway call took {took:.1f}s against a 3 s wall limit"
    assert all(g.reward == 1.0 and g.ended == "done" for g in good)
    assert list((tmp_path / "tools" / "python").iterdir()) == []


async def test_with_end_on_tool_limit_off_the_policy_reads_the_limit_and_answers(tok, tmp_path):
    envs = tools_env(tmp_path, tools=["python"], python_cpu_s=1, end_on_tool_limit=False)
    policy = ScriptedPolicy(tok, [call_text("python", {"code": "while True: pass"}), "1795"])
    ep = await run_episode(envs.new(), PROBLEM, policy, tok, "off", BUDGET)
    assert (ep.reward, ep.policy_turns, ep.ended) == (1.0, 2, "done")
    assert "cpu time limit 1s exceeded" in tok.decode(policy.contexts[1])


def test_observation_turns_appended_by_the_chat_template_equal_the_whole_conversation_rendered(tok):
    """With the template on, prompt + policy turn + observation turn concatenated are the ids of the conversation
    rendered whole: the template's turns are cut where an episode joins them."""
    prompt = prompt_token_ids(tok, "2+3=", "auto")
    policy = tok("5", add_special_tokens=False)["input_ids"]
    observation = turn_ids(tok, "checked", "auto")
    whole = tok.apply_chat_template(
        [
            {"role": "user", "content": "2+3="},
            {"role": "assistant", "content": "5"},
            {"role": "tool", "content": "checked"},
        ],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert prompt + policy + observation == tok(whole, add_special_tokens=False)["input_ids"]


def test_the_calculator_is_exact_and_refuses_what_is_not_integer_arithmetic():
    assert calculate("37*48+19") == 1795 and calculate("-(2+3)*4") == -20
    for bad, why in [
        ("2**100", "parentheses only"),
        ("1/2", "parentheses only"),
        ("x+1", "parentheses only"),
        ("1+", "not"),
    ]:
        with pytest.raises(ValueError, match=why):
            calculate(bad)
    with pytest.raises(ValueError, match="more than 64 digits"):
        calculate("*".join(["99999999999"] * 8))


def test_warm_start_rows_hold_reference_episodes_with_only_the_policys_tokens_as_targets(tok, tmp_path):
    task = ArithmeticTask(max_value=30, operators="+-*")
    envs = tools_env(tmp_path, reference_tool_share=1.0)
    batch, n = warm_start_batch(task, tok, 0, 4, "off", envs)
    row, targets = batch["tokens"][0].tolist(), batch["targets"][0].tolist()
    text = tok.decode(row, skip_special_tokens=False)
    assert "<tool_call>" in text and "<tool_response>" in text
    response = tok("<tool_response>", add_special_tokens=False)["input_ids"][0]
    at = row.index(response)
    assert targets[at - 1] == -1  # the observation's first token is not a target
    assert n == sum(t >= 0 for r in batch["targets"].tolist() for t in r)


async def test_the_token_audit_passes_packed_episodes_and_names_a_sample_whose_ids_changed(tok, tmp_path):
    from rollout.generator import Rollout
    from trainer.rl.batch import TokenAuditError, audit_tokens, packed_rl_batch, rollout_lengths

    envs = tools_env(tmp_path)
    rollouts = []
    for texts in ([call_text("calculator", {"expression": "37*48+19"}), "1795"], ["12"], ["1795"]):
        ep = await run_episode(envs.new(), PROBLEM, ScriptedPolicy(tok, texts), tok, "off", BUDGET)
        rollouts.append(Rollout(ep.sample, ep.reward, ep.text, pieces=ep.trained_turns()))
    tokens, targets, _, _ = padded_batch(rollouts, tok.pad_token_id)
    batch = {"tokens": tokens, "targets": targets, "sample": torch.arange(3)}
    packed, _ = packed_rl_batch(batch, rollout_lengths(rollouts), [slice(0, 3)], 0, 1, tok.pad_token_id)
    owner = packed.pop("sample")
    assert packed["tokens"].shape[0] < 3  # the two short episodes share a row
    figures = audit_tokens(packed["tokens"], packed["targets"], owner, rollouts)
    env = len(rollouts[0].pieces[1].ids)
    assert figures == {
        "audit/samples": 3.0,
        "audit/policy_tokens": float(sum(len(p.ids) for r in rollouts for p in r.pieces if p.by == "policy")),
        "audit/env_tokens": float(env),
    }
    # An observation re-tokenized from its text would differ; here one id of it is changed in the batch.
    row, col = (owner == 0).nonzero()[len(PROBLEM.prompt) + len(rollouts[0].pieces[0].ids) + 1].tolist()
    packed["tokens"][row, col] += 1
    with pytest.raises(TokenAuditError, match="trained sample 0 .* first difference at position"):
        audit_tokens(packed["tokens"], packed["targets"], owner, rollouts)
    packed["tokens"][row, col] -= 1
    packed["targets"][row, col - 1] = 5  # an observation's id made a target
    with pytest.raises(TokenAuditError, match="trained sample 0: the target at position"):
        audit_tokens(packed["tokens"], packed["targets"], owner, rollouts)


async def test_a_later_turn_whose_worker_failed_is_sent_again_and_the_episode_goes_on(tok, tmp_path, caplog):
    """The real SampleGenerator over real Redis, its router a loopback stand-in for the router in front of a worker
    killed while it held an episode's second turn: that request is answered 503 (what the router answers with no
    worker left). The generator waits for a worker and sends the same ids again; the episode completes with every
    id once, as the launched tool demo's killed worker shows at scale (tests/e2e/test_rl_e2e.py)."""
    import logging

    from aiohttp import web

    from common.config import Config, RendezvousConfig
    from common.keys import Keys
    from common.rendezvous import Rendezvous
    from common.roles import RunContext
    from rollout.flow.runtime import SampleRequest
    from rollout.generator import SampleGenerator
    from tests.support.rl_routes import start_app

    call = call_text("calculator", {"expression": "37*48+19"})
    answers = [tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in (call, "1795")]
    sent: list[list[int]] = []

    async def handle(request: web.Request) -> web.Response:
        body = await request.json()
        sent.append(body["token_ids"])
        if len(sent) == 2:  # the second turn's first attempt: its worker is gone
            return web.json_response({"error": {"message": "no healthy worker"}}, status=503)
        ids = answers[0 if len(sent) == 1 else 1]
        choice = {
            "index": 0,
            "token_ids": ids,
            "logprobs": {"content": [{"token_id": t, "logprob": -0.25} for t in ids]},
            "weight_versions": [{"start": 0, "end": len(ids), "version": 2}],
            "finish_reason": "stop",
        }
        return web.json_response({"choices": [choice]})

    runner, url = await start_app(handle)
    rz = Rendezvous(tmp_path / "meet", RendezvousConfig())
    rz.connect(timeout_s=10)
    try:
        cfg = Config()
        cfg.rollout.chat_template = "off"
        cfg.rollout.max_tokens = 48
        cfg.rollout.episode = EpisodeConfig(environment="tools")
        ctx = RunContext(cfg, "trainer", "t-episode", tmp_path / "run", rz.meet, "i0", rz, Keys("t-episode"))
        rz.connect().set(ctx.keys.router(cfg.router.name), url)
        generator = SampleGenerator(cfg, ctx, ArithmeticTask(), tok, tools_env(tmp_path))
        with caplog.at_level(logging.INFO, logger="rollout.generator"):
            rollout = await generator(SampleRequest(7, 1, PROBLEM, 0, 0))
        await generator.close()
    finally:
        await runner.cleanup()
        rz.close()
    prompt = prompt_token_ids(tok, PROBLEM.prompt, "off")
    observation = turn_ids(tok, "<tool_response>\n1795\n</tool_response>", "off")
    assert sent == [prompt, prompt + answers[0] + observation, prompt + answers[0] + observation]
    assert rollout.sample.token_ids == answers[0] + observation + answers[1]
    assert (rollout.reward, rollout.turns, rollout.tool_calls, rollout.env_tokens) == (1.0, 2, 1, len(observation))
    assert "episode 7/1: a later turn's worker failed" in caplog.text
