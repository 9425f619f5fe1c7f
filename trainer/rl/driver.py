"""The RL driver: rank 0 of an RLVR run (`RLTrainer`), which decides what every trainer rank does.

It starts from the exact checkpoint the vLLM workers serve (so version 0 is the same function on both
sides), optionally runs a short supervised warm start on the task's reference answers and publishes the
result as version 0, then hands control to the flow runtime: generation runs on the
GenerationController's event loop through the router, and the runtime calls back into this thread to
train a batch (`train_step`), publish a version (`publish`) and checkpoint (`checkpoint`). Each is a rank
command (trainer/commands.py) that every rank executes. Every step's figures and the run's timing go to
DuckDB (on the flow's clock, `FlowRuntime.origin`), and every trained group to the prompt ledger
(trainer/rl/batch.py).

A trainer that starts where checkpoints exist resumes from the newest: the flow state re-issues what was
in flight, the ledger sets aside the steps the lost run trained after the checkpoint, and the workers are
made to serve the checkpoint's generator weights under a version number the experiment never used
(common/weights/lineage.py keeps the map from versions to the steps the flow policy counts in).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import shutil
import threading
import time
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import torch

from common.metric_sinks import open_metrics
from common.roles import RunContext
from common.weights.fleet import current_version
from common.weights.lineage import Lineage
from common.weights.publisher import WeightPublisher
from common.weights.versions import newest_version, pin_versions, unfinished_versions
from common.weights.writer import count_shards
from rollout.controller import GenerationController
from rollout.environments import load_environments
from rollout.flow.policy import FlowPolicy
from rollout.flow.runtime import FlowReport, FlowRuntime, FlowState, Group
from rollout.flow.strategies import policy_from_config
from rollout.generator import Rollout, SampleGenerator
from rollout.outcomes import ControllerClosed
from rollout.tasks import Problem
from rollout.tasks.load import load_task
from trainer.checkpoint import CheckpointSchedule, TrainState, checkpoint_steps
from trainer.commands import (
    Command,
    RankPeers,
    ResetMoments,
    RLStep,
    Save,
    StartRL,
    Stop,
    StopRequested,
    SupervisedStep,
    TrainerRank,
    WritePart,
)
from trainer.core import StepResult
from trainer.optim import RouterStats, router_figures
from trainer.ranks import Ranks
from trainer.report import write_report
from trainer.rl.advantages import clip_advantages, clip_rewards, group_advantages, zero_variance_groups
from trainer.rl.batch import (
    audit_tokens,
    gen_figures,
    ledger_record,
    packed_rl_batch,
    packed_warm_start_batch,
    padded_batch,
    rewind_ledger,
    rollout_lengths,
    sampling_rows,
    warm_start_batch,
)
from trainer.rl.replay import routing_batch
from trainer.rl.update import mini_batch_rows, rl_step_figures
from trainer.rl.verdict import wait_for_verdict

log = logging.getLogger(__name__)
T = TypeVar("T")

# Points rank 0's metrics writer buffers. A step logs seven gen/* figures per sample (7,168 in the demo), and a
# flush costs ~50 ms: the writer's timer thread (every few seconds) should flush them, not the training thread.
METRICS_BUFFER_POINTS = 100_000


class RLTrainer(TrainerRank):
    """Rank 0 of an RL run: warm start, flow control, generation, publishing; `run()` returns the exit code."""

    def __init__(self, ctx: RunContext, io_loop: asyncio.AbstractEventLoop, ranks: Ranks) -> None:
        super().__init__(ctx, ranks)
        self.io_loop = io_loop  # the role's event loop, idle while this thread trains: runs publishes
        self.task = load_task(self.cfg.rollout.task)
        self.envs = load_environments(self.cfg, self.task, ctx.run_dir)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.model = self.core.model
        self.state = TrainState()
        self.metrics = open_metrics(self.cfg, ctx.run_dir, ctx.exp, "trainer", 0, batch_size=METRICS_BUFFER_POINTS)
        self.audit = ctx.run_dir / "trained_prompts.jsonl"
        self.publisher = WeightPublisher(
            ctx.async_redis(), ctx.keys, self.cfg.rollout, ctx.run_dir, model_files=self.model_dir
        )
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
        self.lineage = Lineage()  # which published version holds which step's weights (common/weights/lineage.py)
        ck = self.cfg.trainer.checkpoint
        self.schedule = CheckpointSchedule(ck.interval_steps, ck.interval_minutes)

    # -- the run -------------------------------------------------------------------------------

    def run(self) -> int:
        """Resume (or warm start), then let the flow runtime drive generation, train steps, publishes and
        checkpoints until its policy finishes; then save, stop the other ranks, and report."""
        resumed = self.resume_or_warm_start()
        policy = policy_from_config(self.cfg.flow, num_prompts=len(self.task), max_steps=self.cfg.trainer.steps)
        generator = SampleGenerator(self.cfg, self.ctx, self.task, self.tokenizer, self.envs)
        runtime = self.start_flow(policy, generator, resumed)
        with self.generating(runtime.controller):
            self._serve(policy.served_step)  # the generators serve the weights the flow state expects
            report = runtime.run()  # calls train_step, publish and checkpoint until the policy finishes
        self.save(runtime.final_state())
        self.command(Stop())
        self.summarise_flow(report, policy)
        self.metrics.close()
        self._io(self.publisher.close())
        self.final_report()
        return 0

    def resume_or_warm_start(self) -> bool:
        """Resume every rank from the newest checkpoint (True), else run the warm start if there is one; the
        lineage and the prompt ledger then follow the state's step."""
        resumed = self.core.resume(self.ckpt_root)
        if resumed is not None:
            self.state = resumed  # with the frozen reference policy and the critic the run had, when it keeps them
        else:
            if self.cfg.trainer.warmup.steps > 0:
                self.warm_start()
            self.command(StartRL())
        self.lineage = Lineage.from_state(self.state.lineage)
        rewind_ledger(self.audit, self.state.step)
        return resumed is not None

    def start_flow(
        self, policy: FlowPolicy, generator: SampleGenerator, resumed: bool
    ) -> FlowRuntime[Problem, Rollout]:
        """The generation controller and the flow runtime with this trainer's callbacks, restored from the
        checkpoint's flow state on a resume."""
        controller = self.controller = GenerationController(
            generator, self.cfg.flow, name="rollout", on_close=generator.close
        )
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
            steps_of=self._steps_of,
        )
        if resumed and self.state.flow_state:
            runtime.load_state_dict(self.state.flow_state)
        self._next_sample = policy.counters.trained_samples  # every sample of the steps trained so far
        return runtime

    @contextlib.contextmanager
    def generating(self, controller: GenerationController) -> Iterator[None]:
        """Close the controller (and with it the generator, its `on_close`) when the flow ends; a controller
        closed by `stop` is a stop."""
        try:
            yield
        except ControllerClosed:
            if self.stop_requested.is_set():
                raise StopRequested("stopped while training") from None
            raise
        finally:
            controller.close()

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
        for step in range(w.steps):
            if self.stop_requested.is_set():
                raise StopRequested(f"stopped during the warm start at step {step}")
            batch, target_tokens = warm_start_batch(
                self.task, self.tokenizer, step, w.batch_size, self.cfg.rollout.chat_template, self.envs
            )
            if self.cfg.trainer.packs():
                batch = packed_warm_start_batch(
                    batch, self.cfg.trainer.pack_tokens, self.ranks.world, self.tokenizer.pad_token_id
                )
            # The warm start does not advance the RL schedule: no schedule tokens, a constant rate of its own.
            result = self.command(SupervisedStep(batch, target_tokens, schedule_tokens=0, lr=w.lr))
            assert result is not None
            loss = result.figures["loss"]
            self.metrics.log("warmup/loss", step, loss)
            if step % 50 == 0 or step == w.steps - 1:
                log.info("warm start step %d/%d loss %.4f", step + 1, w.steps, loss)
        self.command(ResetMoments())

    # -- flow callbacks (trainer thread) -------------------------------------------------------

    def train_step(self, step: int, groups: list[Group[Problem, Rollout]], dropped_groups: int) -> None:
        """One RL step on `groups`; `dropped_groups` zero-variance groups were dropped by flow.dynamic_sampling
        (and replaced by new prompts) while the batch formed. trainer.rl.filter_zero_variance applies to both
        algorithms; under PPO such a group's tokens would still have advantages (reward minus value) and would
        teach the critic, so keeping them (filter_zero_variance = false) is a choice PPO makes sense of."""
        rl = self.cfg.trainer.rl
        t0 = time.monotonic()
        origin = self.flow_origin()
        assert origin is not None, "train steps are flow callbacks: the flow's clock runs"
        rewards = torch.tensor([[r.reward for r in g.samples] for g in groups])
        clipped = clip_rewards(rewards, rl.reward_clip)  # what the advantages see; the figures keep the task's
        # GRPO trains on group advantages; PPO's ranks make per-token advantages from the rewards with the critic.
        if rl.algorithm == "ppo":
            signal = clipped
        else:
            signal = clip_advantages(group_advantages(clipped, rl.normalize_std), rl.advantage_clip)
        keep = ~zero_variance_groups(clipped) if rl.filter_zero_variance else torch.ones(len(groups), dtype=torch.bool)
        used = [(g, signal[i]) for i, g in enumerate(groups) if keep[i]]
        rollouts = [r for g, _ in used for r in g.samples]
        # With no group carrying a signal the step trains nothing: the weights of step + 1 are those of step.
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
            "rl/completion_tokens_mean": sum(len(r.sample.token_ids) - r.env_tokens for r in all_rollouts)
            / len(all_rollouts),
            # Multi-turn episodes: policy turns per episode, the share of episodes that called a tool at least once.
            "rl/turns_mean": sum(r.turns for r in all_rollouts) / len(all_rollouts),
            "rl/tool_call_rate": sum(r.tool_calls > 0 for r in all_rollouts) / len(all_rollouts),
            "rl/staleness_mean": sum(staleness) / len(staleness),
            "rl/staleness_max": max(staleness),
            "perf/step_s": time.monotonic() - t0,
            "perf/step_start_s": t0 - origin,
            # Every sample of the batch, used by the update or not: what the simulator's step cost counts.
            "perf/step_tokens": sum(len(r.sample.prompt_token_ids) + len(r.sample.token_ids) for r in all_rollouts),
            "perf/samples_per_s": self._samples_trained / (time.monotonic() - self._t0),
            # The critic's and the advantages' figures (PPO) carry their own critic/ and rl/ prefixes.
            **{k if k.startswith(("critic/", "rl/")) else f"loss/{k}": v for k, v in stats.items()},
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
            " ".join(
                f"{k}={v:.4g}"
                for k, v in stats.items()
                if k in ("loss", "clip_fraction", "iw_mean", "critic/value_loss")
            ),
        )

    def _update(
        self, step: int, rollouts: list[Rollout], signal: torch.Tensor, group_sizes: list[int]
    ) -> dict[str, float]:
        """The step's optimizer updates (trainer.rl.mini_batches of whole groups) on the decoupled PPO loss
        over every rank; `signal` [B] holds the samples' GRPO advantages, or their rewards under PPO (the
        ranks then compute token advantages with the critic). Returns the loss statistics (the step's parts
        and router telemetry go to `_perf` and `_router`, which train_step logs under perf/ and router/)."""
        t0 = time.perf_counter()
        tokens, targets, behaviour, mask = padded_batch(rollouts, self.tokenizer.pad_token_id)
        n_tokens = int(mask.sum())
        fresh = torch.tensor([float(all(self.lineage.step_of(v) == step for v in r.weight_versions)) for r in rollouts])
        batch = {
            "tokens": tokens,
            "targets": targets,
            "behaviour": behaviour,
            "mask": mask,
            "rewards" if self.cfg.trainer.rl.algorithm == "ppo" else "advantages": signal,
            "fresh": fresh,
            "step_tokens": torch.full((len(rollouts),), float(n_tokens)),
            **sampling_rows(rollouts),
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
        padded_positions = tokens.numel()
        lengths = rollout_lengths(rollouts)
        audit = self.cfg.trainer.rl.audit_tokens
        if audit:  # which sample each row is, packed along with the rest: then which sample each position is
            batch["sample"] = torch.arange(len(rollouts))
        if self.cfg.trainer.packs():
            batch, rows = packed_rl_batch(
                batch, lengths, rows, self.cfg.trainer.pack_tokens, self.ranks.world, self.tokenizer.pad_token_id
            )
        audited: dict[str, float] = {}
        if audit:
            owner = batch.pop("sample")
            if owner.dim() == 1:  # padded rows: a row is its sample up to the sample's length
                positions = torch.arange(tokens.shape[1])
                owner = torch.where(positions < torch.tensor(lengths)[:, None], owner[:, None], -1)
            audited = audit_tokens(batch["tokens"], batch["targets"], owner, rollouts)
        t1 = time.perf_counter()
        result = self.command(RLStep(batch, rows, step))
        t2 = time.perf_counter()
        assert result is not None
        figures = rl_step_figures(result)
        # Logged by train_step beside the step's figures, as pretraining does; none when only the critic trained.
        self._router = result.optim.router if result.updates else []
        # The parts of a step: building the batch, the proximal pass and the updates on every rank (the rest of
        # perf/step_s is rewards, advantages and bookkeeping); trained tokens per second of the whole update.
        self._perf = {
            # Token positions the model computes per pass: the packed rows', and what padding would have computed.
            "perf/positions": float(batch["tokens"].numel()),
            "perf/padded_positions": float(padded_positions),
            "perf/batch_s": t1 - t0,
            "perf/update_s": t2 - t1,
            "perf/train_tokens_per_s": n_tokens / (t2 - t0),
            **audited,
        }
        return figures

    def publish(self, step: int) -> None:
        """Publish the weights of `step` (the trainer's current ones) under the lineage's next version number:
        every rank writes its part of the version; this rank drives the workers."""
        version = self.lineage.next_version()
        # Recorded first: with keep-mode pauses a sample may finish with tokens of the new version before
        # the publish returns, and its versions are translated to steps at once.
        self.lineage.record(step, version)
        self.ranks.broadcast(WritePart(version))
        part = self.core.hf_part()
        counts = self.ranks.all_gather(count_shards(part, self.shard_bytes))
        peers = RankPeers(self.ranks, counts[1:]) if self.ranks.world > 1 else None
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
            "weights/mb": result.bytes / 1e6,  # as written: a delta's compressed bytes (rollout.weight_delta)
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
        self.state.lineage = self.lineage.state()
        self.command(Save(self.state))
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

    def _serve(self, step: int) -> None:
        """Make the generators serve the weights of `step` (those the flow state's generators had) under a
        version number no other weights ever had, before generation (re)starts.

        Nothing to do when the workers serve the lineage's version of `step` and the experiment used no
        higher number. Otherwise the run this one continues went further (or died mid-publish): the weights
        are published again under a new number, from memory when `step` is the trainer's own step, else from
        the committed files of the version the checkpoint's generators served (pinned by `save`)."""
        client, root = self.publisher.client, self.publisher.root
        newest = self._io(newest_version(client, self.ctx.keys, root))
        self.lineage.floor = 0 if newest is None else newest + 1
        served_version = self.lineage.version_of(step)
        if served_version is not None and newest == served_version == self._io(current_version(client, self.ctx.keys)):
            return
        for tmp in unfinished_versions(root):  # a publisher that died mid-write; this trainer is the only one
            shutil.rmtree(tmp, ignore_errors=True)
        if step == self.state.step:
            self.publish(step)
            return
        if served_version is None or not (root / f"v{served_version}").is_dir():
            raise RuntimeError(
                f"resuming at step {self.state.step}: the checkpoint's generators served the weights of step {step} "
                f"(version {served_version}), whose files are gone from {root}; resume from an older checkpoint or "
                "start a new run directory"
            )
        version = self.lineage.next_version()
        self.lineage.record(step, version)
        log.info(
            "resuming at step %d: the generators serve step %d's weights (version %d) again as version %d "
            "(the lost run had reached version %s)",
            self.state.step,
            step,
            served_version,
            version,
            newest,
        )
        self._io(self.publisher.republish(version, served_version))

    # -- the end -------------------------------------------------------------------------------

    def summarise_flow(self, report: FlowReport, policy: FlowPolicy) -> None:
        """The flow's counters to DuckDB and the prompt ledger's totals to flow_summary.json: every admitted
        prompt is trained (see trained_prompts.jsonl), still untrained in the saved flow state, filtered by
        dynamic sampling (listed) or dropped stale (counted)."""
        c = report.counters
        log.info("flow finished: %s; counters %s", report.finish_reason, c)
        self.metrics.log_many(
            self.state.step, {f"flow/{k}": float(v) for k, v in vars(c).items() if isinstance(v, (int, float))}
        )
        summary = {
            "finish_reason": report.finish_reason,
            "admitted_prompts": policy.next_prompt,
            "untrained_prompts": sorted(policy.untrained),
            "filtered_prompts": sorted(policy.filtered),
            "counters": dataclasses.asdict(c),
        }
        (self.ctx.run_dir / "flow_summary.json").write_text(json.dumps(summary, indent=1) + "\n")

    def final_report(self) -> None:
        """Wait (bounded) for the evaluator's verdict on the last evaluated version (and, when it pins
        versions, on every due one), then write the report of what was recorded."""
        ev = self.cfg.evaluator
        final_version = self.lineage.version_of(self.state.step)
        if final_version is None:  # the final weights were never published: without faults version = step
            final_version = self.state.step
        versions = [v for _, v in self.lineage.pairs]
        wait_for_verdict(self.ctx.redis, self.ctx.keys, ev, final_version, versions, self.cfg.trainer.final_eval_wait_s)
        title = f"{self.ctx.exp}: {self.cfg.flow.strategy}"
        benchmark = ev.benchmarks[0] if ev.benchmarks else None
        write_report(self.ctx.redis, self.ctx.keys, self.ctx.run_dir, title, benchmark, self.lineage, self._mismatch)
