"""Episodes: what one RL sample is. An `Environment` gives the first prompt (`reset`) and answers each policy turn
(`step`: an observation for the next turn, a reward, whether the episode is done); `run_episode` plays it against
the policy through the token-in/token-out route and keeps the trajectory as tokens end to end: the first prompt's
ids, then every policy turn's ids exactly as vLLM sampled them (with their behaviour log-probs and weight
versions, mask 1) and every observation's ids as appended (mask 0), never the text of an earlier turn tokenized
again. An observation's ids are its own turn of the chat template (`rollout.chat.turn_ids`), concatenated.

A single-turn task is the one-step environment `TaskEnvironment` (the prompt in, the task's verifier on the
completion), so every sample takes this one path. Environments are built per episode by an `Environments`
object, loaded from `rollout.episode.environment` ("task", "tools", or an import path) by
rollout/environments.py `load_environments`;
its `reference` gives the supervised warm start's trajectory of a problem. The budget: `rollout.episode.max_turns`
policy turns and `max_tokens` tokens after the first prompt (0: up to `rollout.max_model_len`), each turn at most
`rollout.max_tokens`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from rollout.chat import ChatTemplateMode, prompt_token_ids, turn_ids
from rollout.client import Sample
from rollout.tasks import Problem, Task

if TYPE_CHECKING:
    from common.config import Config


@dataclass(frozen=True)
class EnvStep:
    """An environment's answer to one policy turn: the text of the observation the policy reads next (None when
    the episode is done, or an observation the episode ends on), the reward (the episode's, read when done), and
    what the step cost in tools."""

    observation: str | None
    reward: float
    done: bool
    tool_calls: int = 0
    tool_errors: int = 0
    tool_s: float = 0.0


@runtime_checkable
class Environment(Protocol):
    """One episode's environment: `reset` once, then `step` after every policy turn until it says done."""

    async def reset(self, problem: Problem) -> str:
        """The first prompt's text (a user turn when the chat template is on)."""
        ...

    async def step(self, action: str) -> EnvStep:
        """The policy's turn, as text (its tokens decoded without special tokens): the observation or the end."""
        ...


@dataclass(frozen=True)
class Segment:
    """A piece of a reference trajectory: text the policy writes (its turn, EOS added after it) or the
    environment appends (an observation turn)."""

    by: Literal["policy", "env"]
    text: str


@runtime_checkable
class Environments(Protocol):
    """What `rollout.episode.environment` names: a fresh `Environment` per episode, and the reference
    trajectory of a problem for the supervised warm start (the first prompt is the problem's own)."""

    def new(self) -> Environment: ...

    def reference(self, problem: Problem) -> list[Segment]: ...


class TaskEnvironment:
    """A single-turn task as a one-step environment: the problem's prompt, then the task's verifier on the one
    completion (run in a thread: verifiers may take a while, under their own time bound)."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self.problem: Problem | None = None

    async def reset(self, problem: Problem) -> str:
        self.problem = problem
        return problem.prompt

    async def step(self, action: str) -> EnvStep:
        assert self.problem is not None, "reset() comes first"
        return EnvStep(None, await asyncio.to_thread(self.task.reward, self.problem, action), True)


@dataclass(frozen=True)
class TaskEnvironments:
    """`rollout.episode.environment = "task"`: the one-step environment of every problem; its reference is the
    problem's answer."""

    task: Task

    def new(self) -> Environment:
        return TaskEnvironment(self.task)

    def reference(self, problem: Problem) -> list[Segment]:
        return [Segment("policy", problem.answer)]


@dataclass(frozen=True)
class Budget:
    """An episode's limits: policy turns, tokens after the first prompt, tokens per turn, the context length."""

    max_turns: int
    max_tokens: int
    turn_tokens: int
    max_model_len: int

    @classmethod
    def from_config(cls, cfg: Config, *, one_turn: bool = False) -> Budget:
        ro = cfg.rollout
        return cls(
            1 if one_turn else ro.episode.max_turns,
            ro.episode.max_tokens or ro.max_model_len,
            ro.max_tokens,
            ro.max_model_len,
        )


@dataclass(frozen=True)
class Turn:
    """One piece of a played episode, in order: a policy turn (ids as sampled) or an observation (ids appended)."""

    by: Literal["policy", "env"]
    ids: list[int]
    text: str


@dataclass
class Episode:
    """A played episode: the trajectory as one `Sample` (prompt ids; then every later id, with `mask` 1 where
    the policy sampled it and 0 where the environment appended it), its reward, the text of the policy's last
    turn, every piece in order (`turns`, an observation the episode ended on included, which the sample leaves
    out: nothing after it is trained), and what it cost."""

    sample: Sample
    reward: float
    text: str
    turns: list[Turn] = field(default_factory=list)
    policy_turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_s: float = 0.0
    ended: str = ""
    """done (the environment ended it), max_turns, max_tokens (the budget ended it), or length (its last turn
    hit the context)."""

    def trained_turns(self) -> list[Turn]:
        """The turns the sample holds: up to the last policy turn (an observation after it is never trained)."""
        last = max(i for i, t in enumerate(self.turns) if t.by == "policy")
        return self.turns[: last + 1]


# One policy turn: (context ids, the most tokens it may write) -> the sampled Sample of that request.
Generate = Callable[[list[int], int], Awaitable[Sample]]


def _join(into: Sample | None, context: list[int], turn: Sample) -> Sample:
    """The episode's sample so far with one more policy turn; `context` is the turn's prompt (every id so far)."""
    if into is None:
        return turn
    done = len(into.prompt_token_ids) + len(into.token_ids)
    gap = context[done:]  # the observation appended since the last turn: mask 0, the last version carried on
    last = into.versions[-1]
    into.token_ids += gap + turn.token_ids
    into.logprobs += [0.0] * len(gap) + turn.logprobs
    into.versions += [last] * len(gap) + turn.versions
    into.mask = (into.mask or [1] * (done - len(into.prompt_token_ids))) + [0] * len(gap) + [1] * len(turn.token_ids)
    into.routed_experts = turn.routed_experts
    into.finish_reason = turn.finish_reason
    return into


async def run_episode(
    env: Environment,
    problem: Problem,
    generate: Generate,
    tokenizer: Any,
    chat_template: ChatTemplateMode,
    budget: Budget,
    encode: Callable[[str], Sequence[int]] | None = None,
) -> Episode:
    """Play one episode of `env` on `problem`, each policy turn sampled by `generate`. `encode` gives the first
    prompt's ids from its text (a cache of `prompt_token_ids`, which is used without it)."""
    first = await env.reset(problem)
    context = list(encode(first) if encode is not None else prompt_token_ids(tokenizer, first, chat_template))
    prompt_len = len(context)
    sample: Sample | None = None
    turns: list[Turn] = []
    ep = Episode(Sample([], [], [], [], ""), 0.0, "")
    while True:
        room = min(
            budget.turn_tokens, budget.max_tokens - (len(context) - prompt_len), budget.max_model_len - len(context)
        )
        if room <= 0:
            ep.ended = "max_tokens"
            break
        turn = await generate(context, room)
        sample = _join(sample, context, turn)
        text = tokenizer.decode(turn.token_ids, skip_special_tokens=True)
        turns.append(Turn("policy", list(turn.token_ids), text))
        context += turn.token_ids
        ep.policy_turns += 1
        ep.text = text
        result = await env.step(text)
        ep.tool_calls += result.tool_calls
        ep.tool_errors += result.tool_errors
        ep.tool_s += result.tool_s
        ep.reward = result.reward
        if result.observation is not None:
            ids = turn_ids(tokenizer, result.observation, chat_template)
            turns.append(Turn("env", ids, result.observation))
            context += ids
        if result.done:
            ep.ended = "done"
            break
        if ep.policy_turns >= budget.max_turns:
            ep.ended = "max_turns"
            break
        if turn.finish_reason == "length" and len(context) >= budget.max_model_len:
            ep.ended = "length"
            break
    assert sample is not None, "an episode has at least one policy turn (the budget allows one)"
    ep.sample, ep.turns = sample, turns
    return ep
