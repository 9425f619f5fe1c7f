"""The trainer role (`ROLE=trainer`) on each of its W ranks: RLVR (warm start, then the flow controller)
or, with trainer.mode = "pretrain", next-token pretraining; both train only through the training core
(trainer/core.py).

In RL, rank 0 (`RLTrainer`) leads. It starts from the exact checkpoint the vLLM workers serve (so
version 0 is the same function on both sides), optionally runs a short supervised warm start on the
task's reference answers (a cross-entropy loss on the core) and publishes the result as version 0,
then hands control to the flow runtime: generation runs on the GenerationController's event loop
through the router, and the runtime calls back into this thread to train a batch (`train_step`),
publish a version (`publish`) and checkpoint (`checkpoint`). Each of those is a `Command` rank 0
broadcasts and every rank (`TrainerRank`) executes: a train step gives each rank its share of the
batch (GRPO advantages and global normalisation are computed once, on rank 0); a publish has every
rank write its experts into the version while rank 0 writes the dense part and drives the workers; a
checkpoint is sharded. Every step's figures go to DuckDB, and the prompt ids of every trained group
are appended to `<run dir>/trained_prompts.jsonl`, the audit that every prompt is trained exactly once.

The run's timing goes to DuckDB too, for a simulator to learn it from: every trained sample's gen/*
figures (`gen_figures`, step = the sample's number in training order), each step's start and tokens
(perf/step_start_s, perf/step_tokens) and each publish's start (weights/publish_start_s). Their times
are seconds on the flow's clock, whose origin is the moment the flow runtime starts, after the warm start
(`FlowRuntime.origin`; one per trainer process).

A trainer that starts where checkpoints exist resumes from the newest (every rank; the launcher restarts
them together): the flow state re-issues what was in flight, the ledger sets aside the steps trained
after the checkpoint by the lost run, and before generation starts the workers are made to serve the
checkpoint's generator weights under a version number the experiment never used (trainer/versions.py
says why numbers are not reused, and keeps the map from versions to steps that the flow policy needs).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from common.config import Config
from common.metrics import MetricsWriter
from common.net import advertised
from common.roles import REPORT_FILE, RunContext
from common.tasks import cancel_and_join
from rollout.controller import GenerationController
from rollout.flow.runtime import FlowRuntime, FlowState, Group
from rollout.flow.strategies import policy_from_config
from rollout.generator import Rollout, SampleGenerator
from rollout.outcomes import ControllerClosed
from rollout.tasks import Problem, load_task
from rollout.weights import (
    PartReport,
    VersionPart,
    WeightPublisher,
    count_shards,
    current_version,
    newest_version,
    pin_versions,
    unfinished_versions,
)
from trainer.checkpoint import CheckpointSchedule, TrainState, checkpoint_steps
from trainer.core import StepResult, TrainingCore, cross_entropy_loss
from trainer.data.shards import data_root
from trainer.data.tokenizer import data_tokenizer
from trainer.optim import RouterStats, router_figures
from trainer.pretrain import PretrainData, Pretrainer
from trainer.ranks import (
    BOOTSTRAP_TIMEOUT_S,
    RankInfo,
    Ranks,
    RedisStoreAddress,
    dead_ranks,
    form_group,
    rank_info,
    rank_record,
)
from trainer.report import build_rows, format_table, held_out_scores, save_png, wait_for_eval, wait_for_evals
from trainer.rl.advantages import group_advantages, zero_variance_groups
from trainer.rl.replay import routing_batch
from trainer.rl.update import gap_quantile, mini_batch_rows, proximal_fn, rl_updates
from trainer.setup import initial_model, resolve_device
from trainer.tinykit import resolve_model
from trainer.versions import Lineage

log = logging.getLogger(__name__)
T = TypeVar("T")

# How long a stopping trainer waits for its training thread to notice (it is a daemon thread: the role
# exits after this even if the thread is inside a long step; an unfinished checkpoint is never loaded).
STOP_TIMEOUT_S = 5.0
# How often a rank looks at the other ranks' liveness.
RANK_POLL_S = 0.5
# How long a rank whose collective failed waits for the watch to say which rank died.
DEAD_RANK_GRACE_S = 3.0
# Points rank 0's metrics writer buffers. A step logs seven gen/* figures per sample (7,168 in the demo), and a
# flush costs ~50 ms: the writer's timer thread (every few seconds) should flush them, not the training thread.
METRICS_BUFFER_POINTS = 100_000


class StopRequested(RuntimeError):
    """The role was told to stop (SIGTERM) while training."""


def padded_batch(rollouts: list[Rollout], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens [B, L] (prompt + completion, right-padded), targets [B, L] (-1 outside completions),
    behaviour log-probs [B, L] aligned with targets, and the completion mask [B, L]."""
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
        targets[b, p - 1 : p - 1 + n] = torch.tensor(r.sample.token_ids)
        behaviour[b, p - 1 : p - 1 + n] = torch.tensor(r.sample.logprobs)
    return tokens, targets, behaviour, (targets >= 0).float()


@dataclass
class Command:
    """What rank 0 tells every rank to do next (broadcast over the control group; every rank executes it)."""

    op: str
    """sft (a supervised step), reset_moments (the warm start ends), rl (a PPO step), publish, save, or stop."""
    batch: dict[str, torch.Tensor] | None = None
    """The step's global batch (the same rows on every rank; each trains its share)."""
    total: float = 0.0
    """Global normaliser of the supervised loss: its target tokens."""
    tokens: int = 0
    """Trained tokens over all ranks (advances the schedule; sft)."""
    mini_batches: list[slice] | None = None
    """The rows of each optimizer update of an RL step (whole groups)."""
    lr: float | None = None
    step: int = 0
    """The RL step (its samples made entirely by version `step` are fresh)."""
    state: TrainState | None = None


class _RankPeers:
    """Rank 0's side of a publish the other ranks write parts of (rollout.weights.PeerWriters)."""

    def __init__(self, ranks: Ranks, shard_counts: list[int]) -> None:
        self.ranks, self.shard_counts = ranks, shard_counts
        self.called = False

    def write(self, tmp: Path, first_shard: list[int], total_shards: int) -> list[PartReport]:
        self.called = True
        self.ranks.broadcast({"tmp": str(tmp), "first": first_shard, "total": total_shards})
        reports = self.ranks.all_gather(None)[1:]
        failed = [r for r in reports if isinstance(r, str)]
        if failed:
            raise RuntimeError("; ".join(failed))
        return reports

    def cancel(self) -> None:
        """The publish ended before the parts were asked for: release the ranks waiting for a place."""
        self.ranks.broadcast(None)


class TrainerRank:
    """One rank of the trainer: its share of every command. Rank 0 (`RLTrainer`) decides the commands."""

    def __init__(self, ctx: RunContext, ranks: Ranks) -> None:
        self.ctx, self.cfg, self.ranks = ctx, ctx.cfg, ranks
        self.device = ranks.device
        self.model_dir = resolve_model(self.cfg, ctx.run_dir)
        # Version 0 must be the function the workers serve: start from their checkpoint unless told otherwise.
        self.core = TrainingCore(self.cfg, ranks, initial_model(self.cfg, self.device, self.model_dir))
        self.ckpt_root = ctx.run_dir / "checkpoints"
        self.shard_bytes = self.cfg.rollout.weight_shard_mb << 20

    def execute(self, cmd: Command) -> StepResult | None:
        rl = self.cfg.trainer.rl
        if cmd.op == "sft":
            assert cmd.batch is not None
            return self.core.step(
                cmd.batch,
                cross_entropy_loss(int(cmd.total)),
                self.cfg.trainer.warmup.batch_size,
                tokens=cmd.tokens,
                lr=cmd.lr,
            )
        if cmd.op == "rl":
            assert cmd.batch is not None and cmd.mini_batches is not None
            updates = rl_updates(cmd.batch, cmd.mini_batches, rl)
            return self.core.step_updates(updates, rl.micro_batch_samples, prepare=proximal_fn(rl))
        if cmd.op == "publish":  # rank 0's half is RLTrainer.publish: it drives the workers too
            self.write_part(cmd.step)
        elif cmd.op == "reset_moments":
            self.core.optimizer.reset_moments()
        elif cmd.op == "save":
            assert cmd.state is not None
            self.core.save(self.ckpt_root, cmd.state)
        elif cmd.op != "stop":
            raise ValueError(f"unknown trainer command {cmd.op!r}")
        return None

    def write_part(self, version: int) -> None:
        """A rank other than 0 in a publish: write this rank's experts where rank 0 says."""
        part = self.core.hf_part()
        self.ranks.all_gather(count_shards(part, self.shard_bytes))
        where = self.ranks.broadcast()
        if where is None:
            return
        try:
            report: PartReport | str = VersionPart(
                Path(where["tmp"]), version, part, self.shard_bytes, where["first"][self.ranks.rank - 1], where["total"]
            ).write()
        except Exception as exc:  # reported to rank 0, which fails the publish and says why
            report = f"trainer rank {self.ranks.rank}: {type(exc).__name__}: {exc}"
        self.ranks.all_gather(report)

    def follow(self, stop: threading.Event) -> int:
        """Ranks other than 0: resume like rank 0, then execute its commands until it says stop."""
        self.core.resume(self.ckpt_root)
        while not stop.is_set():
            cmd: Command = self.ranks.broadcast()
            self.execute(cmd)
            if cmd.op == "stop":
                return 0
        raise StopRequested("stopped while following rank 0")


def gen_figures(rollout: Rollout, origin: float) -> dict[str, float]:
    """The gen/* figures of one generated sample, its start in seconds since `origin` (the flow's clock).

    A sample held over a resume was generated by the lost process: its start is on that process's monotonic
    clock, before this flow's origin (negative) when both ran on one machine; its durations are exact."""
    s, t = rollout.sample, rollout.timing
    figures = {
        "gen/prompt_tokens": float(len(s.prompt_token_ids)),
        "gen/output_tokens": float(len(s.token_ids)),
        # Unknown (-1): neither the router's answer (the worker's headers and body, which name no worker)
        # nor the Sample says which worker served the request.
        "gen/worker": -1.0,
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


class RLTrainer(TrainerRank):
    """Rank 0 of an RL run: warm start, flow control, generation, publishing; `run()` returns the exit code."""

    def __init__(self, ctx: RunContext, io_loop: asyncio.AbstractEventLoop, ranks: Ranks) -> None:
        super().__init__(ctx, ranks)
        self.io_loop = io_loop  # the role's event loop, idle while this thread trains: runs publishes
        self.task = load_task(self.cfg.rollout.task)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.model = self.core.model
        self.state = TrainState()
        self.metrics = MetricsWriter(ctx.run_dir, ctx.exp, "trainer", 0, batch_size=METRICS_BUFFER_POINTS)
        self.audit = ctx.run_dir / "trained_prompts.jsonl"
        self.publisher = WeightPublisher(ctx.async_redis(), ctx.keys, self.cfg.rollout, ctx.run_dir)
        self.stop_requested = threading.Event()
        self.controller: GenerationController | None = None
        self.runtime: FlowRuntime[Problem, Rollout] | None = None
        self._t0 = time.monotonic()
        self._samples_trained = 0
        # The number of the next trained sample in the gen/* series, continued on resume from the flow state.
        self._next_sample = 0
        # Publishes made before the flow started (the start weights, `_serve`): (version, monotonic start).
        self._early_publishes: list[tuple[int, float]] = []
        self._mismatch: list[float] = []  # trainer-vs-vLLM log-prob gap on fresh samples, per step
        self._router: list[RouterStats] = []  # the last RL update's per-layer router telemetry
        self._perf: dict[str, float] = {}  # the last RL update's parts (seconds) and trained tokens per second
        self.lineage = Lineage()  # which published version holds which step's weights (trainer/versions.py)
        ck = self.cfg.trainer.checkpoint
        self.schedule = CheckpointSchedule(ck.interval_steps, ck.interval_minutes)

    def stop(self) -> None:
        """Ask the run to end (from another thread): warm start checks the flag, the flow runtime's
        wait is ended by closing the generation controller."""
        self.stop_requested.set()
        if self.controller is not None:
            self.controller.close()

    def _io(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.io_loop).result()

    def command(self, cmd: Command) -> StepResult | None:
        """Tell every rank, then do this rank's share."""
        self.ranks.broadcast(cmd)
        return self.execute(cmd)

    # -- warm start ----------------------------------------------------------------------------

    def warm_start(self) -> None:
        """Supervised steps on reference answers (prompt tokens masked out of the loss), on the core."""
        w = self.cfg.trainer.warmup
        eos = self.tokenizer.eos_token_id
        n = len(self.task)
        for step in range(w.steps):
            if self.stop_requested.is_set():
                raise StopRequested(f"stopped during the warm start at step {step}")
            rows, masks = [], []
            for i in range(w.batch_size):
                # Warm-start problems come from the end of the data, away from the RL prompts at its start.
                problem = self.task.problem(n - 1 - ((step * w.batch_size + i) % n))
                prompt = list(self.tokenizer(problem.prompt)["input_ids"])
                answer = list(self.tokenizer(problem.answer)["input_ids"]) + [eos]
                rows.append(prompt + answer)
                masks.append([0] * len(prompt) + [1] * len(answer))
            length = max(map(len, rows))
            tokens = torch.tensor([r + [self.tokenizer.pad_token_id] * (length - len(r)) for r in rows])
            mask = torch.tensor([m + [0] * (length - len(m)) for m in masks])
            targets = torch.where(mask[:, 1:] > 0, tokens[:, 1:], torch.full_like(tokens[:, 1:], -1))
            n_targets = int((targets >= 0).sum())
            # The warm start does not advance the RL schedule: tokens = 0, a constant rate of its own.
            result = self.command(
                Command("sft", {"tokens": tokens[:, :-1], "targets": targets}, total=n_targets, tokens=0, lr=w.lr)
            )
            assert result is not None
            loss = result.figures["loss"]
            self.metrics.log("warmup/loss", step, loss)
            if step % 50 == 0 or step == w.steps - 1:
                log.info("warm start step %d/%d loss %.4f", step + 1, w.steps, loss)
        self.command(Command("reset_moments"))

    # -- flow callbacks (trainer thread) -------------------------------------------------------

    def train_step(self, step: int, groups: list[Group[Problem, Rollout]], dropped_groups: int) -> None:
        """One RL step on `groups`; `dropped_groups` zero-variance groups were dropped by flow.dynamic_sampling
        (and replaced by new prompts) while the batch formed."""
        rl = self.cfg.trainer.rl
        t0 = time.monotonic()
        origin = self.flow_origin()
        assert origin is not None, "train steps are flow callbacks: the flow's clock runs"
        rewards = torch.tensor([[r.reward for r in g.samples] for g in groups])
        advantages = group_advantages(rewards, rl.normalize_std)
        keep = ~zero_variance_groups(rewards) if rl.filter_zero_variance else torch.ones(len(groups), dtype=torch.bool)
        used = [(g, advantages[i]) for i, g in enumerate(groups) if keep[i]]
        rollouts = [r for g, _ in used for r in g.samples]
        # With no group carrying a signal the step trains nothing: version step + 1 has the same weights.
        sizes = [len(g.samples) for g, _ in used]
        stats = self._update(step, rollouts, torch.cat([a for _, a in used]), sizes) if rollouts else {}
        self.state.step = step + 1
        if "fresh_logprob_mismatch" in stats:
            self._mismatch.append(stats["fresh_logprob_mismatch"])
        all_rollouts = [r for g in groups for r in g.samples]
        accuracy = sum(r.reward >= 1.0 for r in all_rollouts) / len(all_rollouts)
        staleness = [step - self.lineage.step_of(min(r.weight_versions)) for r in all_rollouts]
        self._samples_trained += len(all_rollouts)
        reward_mean = float(rewards.mean())
        figures = {
            "rl/reward_mean": reward_mean,
            "rl/accuracy": accuracy,
            "rl/groups_used": len(used),
            "rl/dynamic_dropped_groups": dropped_groups,
            "rl/completion_tokens_mean": sum(len(r.sample.token_ids) for r in all_rollouts) / len(all_rollouts),
            "rl/staleness_mean": sum(staleness) / len(staleness),
            "rl/staleness_max": max(staleness),
            "perf/step_s": time.monotonic() - t0,
            "perf/step_start_s": t0 - origin,
            # Every sample of the batch, used by the update or not: what the simulator's step cost counts.
            "perf/step_tokens": sum(len(r.sample.prompt_token_ids) + len(r.sample.token_ids) for r in all_rollouts),
            "perf/samples_per_s": self._samples_trained / (time.monotonic() - self._t0),
            **{f"loss/{k}": v for k, v in stats.items()},
            **(router_figures(self._router) | self._perf if rollouts else {}),
        }
        self.metrics.log_many(step, figures)
        for n, r in enumerate(all_rollouts, self._next_sample):
            self.metrics.log_many(n, gen_figures(r, origin))
        self._next_sample += len(all_rollouts)
        # Publishes made before the flow started (the start weights), now that its clock runs: negative starts.
        for version, start in self._early_publishes:
            self.metrics.log("weights/publish_start_s", version, start - origin)
        self._early_publishes = []
        with self.audit.open("a") as fh:
            fh.write(json.dumps(ledger_record(step, groups, self.task.name)) + "\n")
        log.info(
            "step %d: reward %.3f accuracy %.3f groups %d/%d (dynamic sampling dropped %d) staleness<=%d %s",
            step,
            reward_mean,
            accuracy,
            len(used),
            len(groups),
            dropped_groups,
            max(staleness),
            " ".join(f"{k}={v:.4g}" for k, v in stats.items() if k in ("loss", "clip_fraction", "iw_mean")),
        )

    def _update(
        self, step: int, rollouts: list[Rollout], advantages: torch.Tensor, group_sizes: list[int]
    ) -> dict[str, float]:
        """The step's optimizer updates (trainer.rl.mini_batches of whole groups) on the decoupled PPO loss
        over every rank; returns the loss statistics (the step's parts and router telemetry go to `_perf`
        and `_router`, which train_step logs under perf/ and router/)."""
        t0 = time.perf_counter()
        tokens, targets, behaviour, mask = padded_batch(rollouts, self.tokenizer.pad_token_id)
        n_tokens = int(mask.sum())
        fresh = torch.tensor([float(all(self.lineage.step_of(v) == step for v in r.weight_versions)) for r in rollouts])
        batch = {
            "tokens": tokens,
            "targets": targets,
            "behaviour": behaviour,
            "mask": mask,
            "advantages": advantages,
            "fresh": fresh,
            "step_tokens": torch.full((len(rollouts),), float(n_tokens)),
        }
        layers = self.model.moe_layer_ids()
        replay = self.cfg.trainer.rl.routing_replay == "rollout"
        # The rollout's routing goes with the batch when every sample has it (the mismatch telemetry), and
        # must when it is replayed (routing_batch then names what is missing).
        if layers and (replay or all(r.sample.routed_experts is not None for r in rollouts)):
            batch["routing"] = routing_batch(
                [r.sample for r in rollouts], tokens.shape[1], layers, self.cfg.trainer.model.num_experts_per_tok
            )
        rows = mini_batch_rows(group_sizes, self.cfg.trainer.rl.mini_batches)
        t1 = time.perf_counter()
        result = self.command(Command("rl", batch, step=step, mini_batches=rows))
        t2 = time.perf_counter()
        assert result is not None
        figures = dict(result.figures)
        figures["updates"] = len(result.updates)
        abs_sum, fresh_tokens = figures.pop("fresh_abs_diff_sum", 0.0), figures.pop("fresh_tokens", 0.0)
        if fresh_tokens > 0:
            figures["fresh_logprob_mismatch"] = abs_sum / fresh_tokens
        figures["behaviour_proximal_abs_logp_diff_p99"] = gap_quantile(figures.pop("gap_hist"), 0.99)
        differ, compared = figures.pop("routing_differ", 0.0), figures.pop("routing_compared", 0.0)
        if compared > 0:
            figures["routing_disagreement"] = differ / compared
        figures["grad_norm"] = sum(u.grad_norm for u in result.updates) / len(result.updates)
        self._router = result.optim.router  # logged by train_step beside the step's figures, as pretraining does
        # The parts of a step: building the batch, the proximal pass and the updates on every rank (the rest of
        # perf/step_s is rewards, advantages and bookkeeping); trained tokens per second of the whole update.
        self._perf = {
            "perf/batch_s": t1 - t0,
            "perf/update_s": t2 - t1,
            "perf/train_tokens_per_s": n_tokens / (t2 - t0),
        }
        return figures

    def publish(self, step: int) -> None:
        """Publish the weights of `step` (the trainer's current ones) under the lineage's next version number:
        every rank writes its part of the version; this rank drives the workers."""
        version = self.lineage.next_version()
        # Recorded first: with keep-mode pauses a sample may finish with tokens of the new version before
        # the publish returns, and its versions are translated to steps at once.
        self.lineage.record(step, version)
        self.ranks.broadcast(Command("publish", step=version))
        part = self.core.hf_part()
        counts = self.ranks.all_gather(count_shards(part, self.shard_bytes))
        peers = _RankPeers(self.ranks, counts[1:]) if self.ranks.world > 1 else None
        start = time.monotonic()
        try:
            result = self._io(self.publisher.publish(version, part, peers=peers))
        finally:
            if peers is not None and not peers.called:
                peers.cancel()
        figures = {
            "weights/publish_s": result.total_s,
            "weights/max_pause_s": result.max_pause_s,
            "weights/write_s": result.write_s,
            "weights/max_load_s": result.max_load_s,
        }
        origin = self.flow_origin()
        if origin is None:
            self._early_publishes.append((version, start))  # logged by the first train step
        else:
            figures["weights/publish_start_s"] = start - origin
        self.metrics.log_many(version, figures)

    def flow_origin(self) -> float | None:
        """The origin of the flow's clock (`FlowRuntime.origin`), None until the flow runtime starts."""
        return None if self.runtime is None else self.runtime.origin

    def checkpoint(self, next_step: int, flow_state: FlowState) -> None:
        if self.schedule.due(next_step):
            self.save(flow_state)

    def save(self, flow_state: FlowState) -> None:
        self.state.flow_state = flow_state
        self.state.versions = self.lineage.state()
        self.command(Command("save", state=self.state))
        self.metrics.flush()  # the checkpoint's steps are never retrained: their figures go to disk with it
        self.schedule.saved()
        # A resume from a kept checkpoint at step S republishes the files of the version its generators
        # served (step S - 1's, or S's after the last step): those stay on disk whatever keep_versions says.
        steps = {s for k in checkpoint_steps(self.ckpt_root) for s in (k - 1, k)}
        pin_versions(self.publisher.root, self.lineage.versions_of(steps))
        log.info("checkpoint at step %d", self.state.step)

    def _steps_of(self, result: Rollout) -> tuple[int, int]:
        """The oldest and newest step whose weights produced a sample's tokens (the flow policy counts steps)."""
        return self.lineage.step_of(min(result.weight_versions)), self.lineage.step_of(max(result.weight_versions))

    def _rewind_ledger(self) -> None:
        """Steps at or after the resumed one were trained by a run lost to a crash: their weights are gone,
        so their prompts were not trained. Their ledger lines move to trained_prompts.abandoned.jsonl."""
        if not self.audit.exists():
            return
        lines = self.audit.read_text().splitlines(keepends=True)
        kept = [line for line in lines if json.loads(line)["step"] < self.state.step]
        if len(kept) == len(lines):
            return
        with (self.ctx.run_dir / "trained_prompts.abandoned.jsonl").open("a") as fh:
            fh.writelines(line for line in lines if json.loads(line)["step"] >= self.state.step)
        tmp = self.audit.with_suffix(".tmp")
        tmp.write_text("".join(kept))
        os.replace(tmp, self.audit)
        log.warning(
            "ledger: %d step(s) trained after step %d by the lost run moved to %s",
            len(lines) - len(kept),
            self.state.step,
            "trained_prompts.abandoned.jsonl",
        )

    def _serve(self, step: int) -> None:
        """Make the generators serve the weights of `step` (the flow state's generator version) under a version
        number no other weights ever had, before generation (re)starts.

        Nothing to do when the workers serve the lineage's version of `step` and the experiment used no
        higher number. Otherwise the run this one continues went further (or died mid-publish): the weights
        are published again under a new number, from memory when `step` is the trainer's own step, else from
        the committed files of the version the checkpoint's generators served (pinned by `save`)."""
        client, root = self.publisher.client, self.publisher.root
        newest = self._io(newest_version(client, self.ctx.keys, root))
        self.lineage.floor = 0 if newest is None else newest + 1
        served = self.lineage.version_of(step)
        if served is not None and newest == served == self._io(current_version(client, self.ctx.keys)):
            return
        for tmp in unfinished_versions(root):  # a publisher that died mid-write; this trainer is the only one
            shutil.rmtree(tmp, ignore_errors=True)
        if step == self.state.step:
            self.publish(step)
            return
        if served is None or not (root / f"v{served}").is_dir():
            raise RuntimeError(
                f"resuming at step {self.state.step}: the checkpoint's generators served the weights of step {step} "
                f"(version {served}), whose files are gone from {root}; resume from an older checkpoint or start a "
                "new run directory"
            )
        version = self.lineage.next_version()
        self.lineage.record(step, version)
        log.info(
            "resuming at step %d: the generators serve step %d's weights (version %d) again as version %d "
            "(the lost run had reached version %s)",
            self.state.step,
            step,
            served,
            version,
            newest,
        )
        self._io(self.publisher.republish(version, served))

    # -- the run -------------------------------------------------------------------------------

    def run(self) -> int:
        tc, flow = self.cfg.trainer, self.cfg.flow
        resumed = self.core.resume(self.ckpt_root)
        if resumed is not None:
            self.state = resumed
        elif tc.warmup.steps > 0:
            self.warm_start()
        self.lineage = Lineage.from_state(self.state.versions)
        self._rewind_ledger()
        policy = policy_from_config(flow, num_prompts=len(self.task), max_steps=tc.steps)
        generator = SampleGenerator(self.cfg, self.ctx, self.task, self.tokenizer)
        controller = self.controller = GenerationController.from_config(generator, flow, name="rollout")
        if self.stop_requested.is_set():
            controller.close()
        controller.set_tqdm(disabled=False, total=None, desc="samples")
        runtime = self.runtime = FlowRuntime(
            policy,
            controller,
            lambda i: self.task.problem(i) if i < len(self.task) else None,
            self.train_step,
            self.publish,
            checkpoint=self.checkpoint,
            versions=self._steps_of,
        )
        if resumed is not None and self.state.flow_state:
            runtime.load_state_dict(self.state.flow_state)
        self._next_sample = policy.counters.trained_samples  # every sample of the steps trained so far
        try:
            self._serve(policy.published)
            report = runtime.run()
        except ControllerClosed:
            if self.stop_requested.is_set():
                raise StopRequested("stopped while training") from None
            raise
        finally:
            with contextlib.suppress(ControllerClosed):
                controller.run_coroutine(generator.close()).result(timeout=10)
            controller.close()
        self.save(runtime.final_state())
        self.command(Command("stop"))
        c = report.counters
        log.info("flow finished: %s; counters %s", report.finish_reason, c)
        self.metrics.log_many(
            self.state.step, {f"flow/{k}": float(v) for k, v in vars(c).items() if isinstance(v, (int, float))}
        )
        # The prompt ledger: every admitted prompt is trained (see trained_prompts.jsonl), still
        # untrained in the saved flow state, filtered by dynamic sampling (listed) or dropped stale (counted).
        summary = {
            "finish_reason": report.finish_reason,
            "admitted_prompts": policy.next_prompt,
            "untrained_prompts": sorted(policy.untrained),
            "filtered_prompts": sorted(policy.filtered),
            "counters": dataclasses.asdict(c),
        }
        (self.ctx.run_dir / "flow_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        self.metrics.close()
        self._io(self.publisher.close())
        self.final_report()
        return 0

    def final_report(self) -> None:
        """Wait (bounded) for the evaluator's verdict on the last evaluated version (and, when it pins
        versions, on every due one), then print the table of the run and draw reward and held-out accuracy against step into report.png."""
        ev = self.cfg.evaluator
        benchmark = ev.benchmarks[0] if ev.benchmarks else None
        client = self.ctx.redis
        evaluator_alive = bool(list(client.scan_iter(self.ctx.keys.role_pattern("evaluator"), count=100)))
        final = self.lineage.version_of(self.state.step)
        final = self.state.step if final is None else final
        last = final - final % ev.every_n_versions
        if benchmark and evaluator_alive:
            log.info(
                "waiting up to %.0fs for the evaluator's %s result of version %d",
                self.cfg.trainer.final_eval_wait_s,
                benchmark,
                last,
            )
            deadline = time.monotonic() + self.cfg.trainer.final_eval_wait_s
            if not wait_for_eval(client, self.ctx.keys, last, benchmark, self.cfg.trainer.final_eval_wait_s):
                log.warning("no %s result for version %d yet; the table shows what was evaluated", benchmark, last)
            elif client.hlen(self.ctx.keys.eval_workers):
                # A pinning evaluator measures every due version, newest first, then backfills the older ones.
                due = {v for _, v in self.lineage.pairs if v % ev.every_n_versions == 0 and v <= last}
                missing = wait_for_evals(client, self.ctx.keys, due, benchmark, max(0.0, deadline - time.monotonic()))
                if missing:
                    log.warning(
                        "no %s result yet for version(s) %s; the table shows what was evaluated",
                        benchmark,
                        sorted(missing),
                    )
        heldout = held_out_scores(client, self.ctx.keys, benchmark) if benchmark else {}
        # The table is by step: a version holds the weights of one step (several, after a resume).
        by_step = {self.lineage.step_of(v): score for v, score in sorted(heldout.items()) if v in self.lineage}
        rows = build_rows(self.ctx.run_dir, by_step)
        lines = [format_table(rows, every=max(1, len(rows) // 20))]
        png = save_png(rows, self.ctx.run_dir / "report.png", f"{self.ctx.exp}: {self.cfg.flow.strategy}")
        if heldout:
            first, final = min(heldout), max(heldout)
            lines.append(
                f"held-out {benchmark}: {heldout[first]:.3f} at version {first} -> {heldout[final]:.3f} at "
                f"version {final} ({100 * (heldout[final] - heldout[first]):+.1f} points)"
            )
        if self._mismatch:
            lines.append(
                f"trainer-vs-vLLM log-prob mismatch on fresh samples: mean "
                f"{sum(self._mismatch) / len(self._mismatch):.3g}, max {max(self._mismatch):.3g} nats per "
                f"token ({len(self._mismatch)} steps)"
            )
        lines.append(f"report: {png}; metrics: {self.ctx.run_dir / 'metrics'}")
        text = "\n".join(lines)
        print(text, flush=True)
        (self.ctx.run_dir / REPORT_FILE).write_text(text + "\n")


def _thread(fn: Callable[[], int], name: str) -> asyncio.Future[int]:
    """Run fn in a daemon thread: a rank stuck in a collective with a dead peer must not keep the process alive."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[int] = loop.create_future()

    def body() -> None:
        def settle(result: Any = None, exc: BaseException | None = None) -> None:
            if not future.done():
                future.set_exception(exc) if exc is not None else future.set_result(result)

        try:
            result: Any = fn()
        except BaseException as exc:  # handed to the event loop, which raises it in the role
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, result)

    threading.Thread(target=body, name=name, daemon=True).start()
    return future


async def _watch_ranks(ctx: RunContext, ranks: Ranks) -> str:
    """Return (the reason) as soon as another trainer rank is gone; runs until cancelled otherwise."""
    client = ctx.async_redis()
    try:
        while True:
            await asyncio.sleep(RANK_POLL_S)
            raw = await client.hgetall(ctx.keys.trainer_ranks)
            records = {int(r): json.loads(v) for r, v in raw.items()}
            instances = sorted(records)
            alive = await client.mget([ctx.keys.role_alive("trainer", records[r]["instance"]) for r in instances])
            dead = dead_ranks(records, {r: a is not None for r, a in zip(instances, alive, strict=True)}, ranks.rank)
            if dead:
                return "; ".join(f"trainer rank {r} died ({why})" for r, why in dead)
    finally:
        await client.aclose()


def _store_host(ctx: RunContext) -> str:
    """The address of rank 0's process-group store that the other ranks are told."""
    assert ctx.rendezvous.info is not None
    setting = ctx.cfg.trainer.parallel.store_advertise_host
    return advertised("0.0.0.0", setting, ctx.rendezvous.info.host, "trainer.parallel.store_advertise_host")


def _device(cfg: Config, info: RankInfo) -> torch.device:
    device = resolve_device(cfg.trainer.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", info.local_rank)
    return device


def stop_within(stop: Callable[[], None], timeout_s: float) -> bool:
    """Call `stop` from a daemon thread and wait at most `timeout_s` for it; False (logged) if it did not return.
    A stop on SIGTERM closes the generation controller, whose progress bar takes tqdm's process-wide lock: in a
    CI run (2026-12-04) that lock was never released and the restarted trainer of a killed launcher hung in
    its stop for good, so the stop must not hold the role's exit."""
    thread = threading.Thread(target=stop, name="trainer-stop", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        log.error("stopping the trainer did not return within %.0fs; the role exits without waiting for it", timeout_s)
        return False
    return True


async def main(ctx: RunContext) -> int:
    """ROLE=trainer on one rank: form the group, then RL (rank 0 leads, the others follow) or pretraining.

    Training runs in a thread while this loop serves rank 0's publishes and watches the other ranks. A
    thread cannot be cancelled: on SIGTERM the trainer is told to stop and the role waits a bounded time;
    when another rank died, this rank names it and exits non-zero at once (its thread may be blocked in
    a collective with the dead rank; it is a daemon thread and does not hold the process).
    """
    info = rank_info(os.environ)
    device = _device(ctx.cfg, info)
    client = ctx.redis
    store = RedisStoreAddress(client, ctx.keys.trainer_store)
    ranks = await asyncio.to_thread(form_group, info, device, store, BOOTSTRAP_TIMEOUT_S, _store_host(ctx))
    record = rank_record(ctx.instance)
    client.hset(ctx.keys.trainer_ranks, str(ranks.rank), json.dumps(record))
    # Every rank's record is this group's before any rank watches the others: a record left by a rank of
    # an earlier trainer (restarted) would otherwise read as a dead rank.
    await asyncio.to_thread(ranks.all_gather, None)
    stopping = threading.Event()
    trainer: RLTrainer | None = None
    if ctx.cfg.trainer.mode == "pretrain":
        work = _thread(lambda: _pretrain(ctx, ranks), "pretrain")
    elif ranks.is_main:
        # Built off the loop (tokenizer, model): the heartbeats must keep beating meanwhile.
        trainer = await asyncio.to_thread(RLTrainer, ctx, asyncio.get_running_loop(), ranks)
        work = _thread(trainer.run, "rl-trainer")
    else:
        follower = await asyncio.to_thread(TrainerRank, ctx, ranks)
        work = _thread(lambda: follower.follow(stopping), f"rank-{ranks.rank}")
    watch = asyncio.ensure_future(_watch_ranks(ctx, ranks))
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work in done and work.exception() is None:
            client.hset(ctx.keys.trainer_ranks, str(ranks.rank), json.dumps({**record, "state": "done"}))
            return work.result()
        if work in done:
            # A collective with a dead rank fails at once; the watch names the rank soon after.
            done, _ = await asyncio.wait({watch}, timeout=DEAD_RANK_GRACE_S)
        if watch in done:
            log.error("%s; stopping trainer rank %d", watch.result(), ranks.rank)
            return 1
        return work.result()  # raises the training thread's error
    except asyncio.CancelledError:
        stopping.set()
        if trainer is not None:
            stop_within(trainer.stop, STOP_TIMEOUT_S)
        done, _ = await asyncio.wait({work}, timeout=STOP_TIMEOUT_S)
        if not done:
            log.error("the training thread did not stop within %.0fs", STOP_TIMEOUT_S)
        raise
    finally:
        # A watch whose cancel was lost ran on for good and this rank never ended (2026-12-04: 1 launch in 12,
        # a cancel dropped inside a Redis command, which our connections now raise again): common/tasks.py.
        await cancel_and_join(watch, STOP_TIMEOUT_S, "the watch of the other trainer ranks")
        if work.done() and not work.cancelled() and work.exception() is None:
            ranks.close()
        client.close()


def _pretrain(ctx: RunContext, ranks: Ranks) -> int:
    """trainer.mode = "pretrain" on this rank: trainer.data through the core, metrics to DuckDB (rank 0)."""
    cfg = ctx.cfg
    d = cfg.trainer.data
    if d.sources:  # prepped by `slipstream prep`: the tokenizer only checks that they match
        root = data_root(cfg)
        tokenizer = str(data_tokenizer(cfg, root))
        data = PretrainData("", d.seq_len, d.batch_size, tokenizer, sources=d.sources, root=str(root))
    else:
        tokenizer = d.tokenizer or (str(resolve_model(cfg, ctx.run_dir)) if d.path.endswith(".jsonl") else "")
        data = PretrainData(d.path, d.seq_len, d.batch_size, tokenizer, d.text_key)
    with MetricsWriter(ctx.run_dir, ctx.exp, "trainer", ranks.rank) as metrics:
        Pretrainer(cfg, data, ctx.run_dir, metrics, ranks=ranks).run()
    return 0
