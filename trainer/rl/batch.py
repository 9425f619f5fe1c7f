"""What the RL driver makes of its data besides the update: the warm start's batches, the padded training batch and
its packed form (trainer/pack.py), the gen/*
figures of every trained sample (what a simulator learns the run's timing from), and the prompt ledger
(`trained_prompts.jsonl`, the audit that every prompt is trained exactly once), with its rewind on resume.
Pure functions of their inputs, but for the ledger's file."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from common.http import worker_replica
from rollout.chat import ChatTemplateMode, prompt_token_ids, turn_ids
from rollout.episode import Environments, TaskEnvironments, Turn
from rollout.flow.runtime import Group
from rollout.generator import Rollout
from rollout.tasks import Problem, Task
from trainer.pack import pack_batch

log = logging.getLogger(__name__)

ABANDONED_LEDGER = "trained_prompts.abandoned.jsonl"


def padded_batch(rollouts: list[Rollout], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens [B, L] (prompt + completion, right-padded: an episode's ids exactly as sampled and appended),
    targets [B, L] (-1 outside completions and on the tokens an environment appended, `Sample.mask` 0), behaviour
    log-probs [B, L] aligned with targets, and the trained-token mask [B, L]."""
    seqs = [r.sample.prompt_token_ids + r.sample.token_ids for r in rollouts]
    length = max(len(s) for s in seqs)
    B = len(rollouts)
    tokens = torch.full((B, length), pad_id, dtype=torch.long)
    targets = torch.full((B, length), -1, dtype=torch.long)
    behaviour = torch.zeros(B, length)
    for b, (r, seq) in enumerate(zip(rollouts, seqs, strict=True)):
        tokens[b, : len(seq)] = torch.tensor(seq)
        p, n = len(r.sample.prompt_token_ids), len(r.sample.token_ids)
        # Position t predicts token t+1: completion token j sits at p + j and is predicted at p + j - 1.
        completion = torch.tensor(r.sample.token_ids)
        if r.sample.mask is not None:
            completion = torch.where(torch.tensor(r.sample.mask, dtype=torch.bool), completion, -1)
        targets[b, p - 1 : p - 1 + n] = completion
        behaviour[b, p - 1 : p - 1 + n] = torch.tensor(r.sample.logprobs)
    return tokens, targets, behaviour, (targets >= 0).float()


def sampling_rows(rollouts: list[Rollout]) -> dict[str, torch.Tensor]:
    """Each row's sampling parameters, as its sample was drawn ({"temperature", "top_p"} float32 [B],
    {"top_k"} int64 [B]): the distribution the trainer takes its log-probs under (trainer.model.sampling)."""
    return {
        "temperature": torch.tensor([r.sample.temperature for r in rollouts], dtype=torch.float32),
        "top_k": torch.tensor([r.sample.top_k for r in rollouts], dtype=torch.long),
        "top_p": torch.tensor([r.sample.top_p for r in rollouts], dtype=torch.float32),
    }


def warm_start_batch(
    task: Task,
    tokenizer: Any,
    step: int,
    batch_size: int,
    chat_template: ChatTemplateMode,
    envs: Environments | None = None,
) -> tuple[dict[str, torch.Tensor], int]:
    """Warm-start step `step`'s batch of reference episodes ({"tokens", "targets"}: only the policy's tokens are
    targets) and its number of target tokens. Its problems come from the end of the data, away from the RL
    prompts at its start. Each row is the ids an episode would hold (`envs.reference`, rollout/episode.py): the
    prompt as the RL generator sends it (`chat_template`: rollout.chat_template), each policy turn's tokens and
    EOS after them, as the policy would sample them, each observation as the episode appends it (`envs` None:
    the task's one-turn episodes, the answer)."""
    envs = envs if envs is not None else TaskEnvironments(task)
    n = len(task)
    rows, masks = [], []
    for i in range(batch_size):
        problem = task.problem(n - 1 - ((step * batch_size + i) % n))
        row = prompt_token_ids(tokenizer, problem.prompt, chat_template)
        trained = [0] * len(row)
        for segment in envs.reference(problem):
            if segment.by == "env":
                ids = turn_ids(tokenizer, segment.text, chat_template)
            else:  # a turn continues the ids before it: no special tokens of a sequence start in between
                ids = list(tokenizer(segment.text, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
            row += ids
            trained += [int(segment.by == "policy")] * len(ids)
        rows.append(row)
        masks.append(trained)
    length = max(map(len, rows))
    tokens = torch.tensor([r + [tokenizer.pad_token_id] * (length - len(r)) for r in rows])
    mask = torch.tensor([m + [0] * (length - len(m)) for m in masks])
    targets = torch.where(mask[:, 1:] > 0, tokens[:, 1:], torch.full_like(tokens[:, 1:], -1))
    return {"tokens": tokens[:, :-1], "targets": targets}, int((targets >= 0).sum())


def rollout_lengths(rollouts: list[Rollout]) -> list[int]:
    """Each rollout's tokens (prompt + completion): its padded row's first positions, what packing lays out."""
    return [len(r.sample.prompt_token_ids) + len(r.sample.token_ids) for r in rollouts]


def packed_rl_batch(
    batch: dict[str, torch.Tensor],
    lengths: list[int],
    parts: list[slice],
    pack_tokens: int,
    world: int,
    pad_id: int,
) -> tuple[dict[str, torch.Tensor], list[slice]]:
    """An RL step's batch of one padded row per rollout (`padded_batch`, `sampling_rows` and the per-sample
    tensors beside them; `lengths`: each row's tokens, `rollout_lengths`) packed (trainer/pack.py), each PPO
    mini-batch (`parts`) on its own, in rows of `pack_tokens` (0: the longest sample) balanced over `world`
    ranks. Returns the batch and the mini-batches' rows in it."""
    # A packed row's padding is never trained (targets -1, mask 0) and is taken at temperature 1, untruncated; it
    # belongs to no sample (the token audit's owner -1).
    fill = {"tokens": pad_id, "targets": -1, "routing": -1, "temperature": 1, "top_p": 1, "sample": -1}
    return pack_batch(batch, lengths, parts, pack_tokens or max(lengths), world, fill)


def packed_warm_start_batch(
    batch: dict[str, torch.Tensor], pack_tokens: int, world: int, pad_id: int
) -> dict[str, torch.Tensor]:
    """A `warm_start_batch` packed (trainer/pack.py) in rows of `pack_tokens` (0: the longest) over `world` ranks.
    A row's sample ends at its last target: its answer's EOS, predicted at the sample's last position."""
    last = (batch["targets"] >= 0).int().cumsum(1).argmax(1)  # the first index of the final count
    lengths = [int(n) + 1 for n in last]
    fill = {"tokens": pad_id, "targets": -1}
    packed, _ = pack_batch(batch, lengths, [slice(0, len(lengths))], pack_tokens or max(lengths), world, fill)
    return packed


class TokenAuditError(RuntimeError):
    """A trained row does not hold the ids its episode recorded (trainer.rl.audit_tokens)."""


def audit_tokens(
    tokens: torch.Tensor, targets: torch.Tensor, owner: torch.Tensor, rollouts: list[Rollout]
) -> dict[str, float]:
    """trainer.rl.audit_tokens: every rollout's positions in the batch the ranks train on (`owner` [R, S]: the
    index into `rollouts` of each position's sample, -1 for padding) hold its prompt's ids and then its episode's
    turns' ids as recorded (`Rollout.pieces`; a single turn without pieces: its sampled ids), in order, and the
    targets are the next id where the policy sampled it and -1 elsewhere. Raises TokenAuditError naming the first
    sample that differs; returns the step's audit/* figures."""
    policy = env = 0
    for b, r in enumerate(rollouts):
        where = owner == b
        ids, got = tokens[where].tolist(), targets[where].tolist()
        pieces = r.pieces if r.pieces is not None else [Turn("policy", r.sample.token_ids, r.text)]
        expected, sampled = list(r.sample.prompt_token_ids), [False] * len(r.sample.prompt_token_ids)
        for piece in pieces:
            expected += piece.ids
            sampled += [piece.by == "policy"] * len(piece.ids)
        if ids != expected:
            at = next(
                (i for i, (x, y) in enumerate(zip(ids, expected, strict=False)) if x != y), min(len(ids), len(expected))
            )
            raise TokenAuditError(
                f"trained sample {b} (prompt {r.sample.prompt_token_ids[:8]}...) holds {len(ids)} ids where its "
                f"episode recorded {len(expected)}; first difference at position {at}: "
                f"{ids[at : at + 4]} trained, {expected[at : at + 4]} recorded"
            )
        want = [expected[t + 1] if sampled[t + 1] else -1 for t in range(len(expected) - 1)] + [-1]
        if got != want:
            at = next(i for i, (x, y) in enumerate(zip(got, want, strict=True)) if x != y)
            raise TokenAuditError(
                f"trained sample {b}: the target at position {at} is {got[at]}, expected {want[at]} (a "
                f"{'policy' if want[at] >= 0 else 'non-policy'} token)"
            )
        policy += sum(sampled)
        env += len(sampled) - sum(sampled) - len(r.sample.prompt_token_ids)
    return {"audit/samples": float(len(rollouts)), "audit/policy_tokens": float(policy), "audit/env_tokens": float(env)}


def gen_figures(rollout: Rollout, origin: float) -> dict[str, float]:
    """The gen/* figures of one generated sample, its start in seconds since `origin` (the flow's clock).

    A sample held over a resume was generated by the lost process: its start is on that process's monotonic
    clock, before this flow's origin (negative) when both ran on one machine; its durations are exact."""
    s, t = rollout.sample, rollout.timing
    figures = {
        "gen/prompt_tokens": float(len(s.prompt_token_ids)),
        # An episode's: the policy's tokens over all its turns, the environment's, its turns and tool seconds.
        "gen/output_tokens": float(len(s.token_ids) - rollout.env_tokens),
        "gen/env_tokens": float(rollout.env_tokens),
        "gen/turns": float(rollout.turns),
        "gen/tool_s": rollout.tool_s,
        # The replica index of the worker that generated it (the router names it; common.http.worker_replica),
        # -1 when unknown (a Sample from before the router named workers, or not served through a router).
        "gen/worker": float(worker_replica(s.worker)),
    }
    if t is not None:  # None: a rollout from a checkpoint of a trainer that did not time its samples
        figures |= {
            "gen/start_s": t.sent - origin,
            "gen/queue_s": t.queue_s,
            "gen/generate_s": t.generate_s,
            "gen/concurrency": float(t.concurrency),
        }
    return figures


def ledger_record(step: int, groups: list[Group[Problem, Rollout]], task_name: str) -> dict[str, Any]:
    """One line of trained_prompts.jsonl: the step, its prompts' flow indices and, aligned with them, the
    source each prompt came from (the mixture source, or the task's name for a single-source task)."""
    return {
        "step": step,
        "prompt_ids": [g.prompt_id for g in groups],
        "sources": [g.prompt.source or task_name for g in groups],
    }


def rewind_ledger(ledger: Path, resumed_step: int) -> None:
    """Steps at or after the resumed one were trained by a run lost to a crash: their weights are gone,
    so their prompts were not trained. Their ledger lines move to trained_prompts.abandoned.jsonl beside it."""
    if not ledger.exists():
        return
    lines = ledger.read_text().splitlines(keepends=True)
    kept = [line for line in lines if json.loads(line)["step"] < resumed_step]
    if len(kept) == len(lines):
        return
    with (ledger.parent / ABANDONED_LEDGER).open("a") as fh:
        fh.writelines(line for line in lines if json.loads(line)["step"] >= resumed_step)
    tmp = ledger.with_suffix(".tmp")
    tmp.write_text("".join(kept))
    os.replace(tmp, ledger)
    log.warning(
        "ledger: %d step(s) trained after step %d by the lost run moved to %s",
        len(lines) - len(kept),
        resumed_step,
        ABANDONED_LEDGER,
    )
