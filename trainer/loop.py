"""The RL trainer role (`ROLE=trainer`): warm start, then RLVR through the flow controller.

One `RLTrainer` owns the model, the optimizer and the run's bookkeeping. It starts from the exact
checkpoint the vLLM workers serve (so version 0 is the same function on both sides), optionally
runs a short supervised warm start on the task's reference answers and publishes the result as
version 0, then hands control to the flow runtime: generation runs on the GenerationController's
event loop through the router, and the runtime calls back into this thread to train a batch
(`train_step`), publish a version (`publish`) and checkpoint (`checkpoint`). A train step computes
GRPO advantages per prompt group, recomputes the proximal log-probs with the current weights,
and takes one optimizer step on the decoupled PPO loss. Every step's figures go to DuckDB, and the
prompt ids of every trained group are appended to `<run dir>/trained_prompts.jsonl`, the audit
that every prompt is trained exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import torch
import torch.nn.functional as F

from common.config import Config
from common.metrics import MetricsWriter
from common.roles import RunContext
from rollout.client import NoRouterError, RolloutClient, RolloutError, Sample
from rollout.controller import ControllerClosed, GenerationController
from rollout.flow.policy import FlowPolicy
from rollout.flow.runtime import FlowRuntime, Group, SampleRequest
from rollout.tasks import Problem, Task, load_task
from rollout.tinykit import resolve_model
from rollout.weights import WeightPublisher, current_version
from trainer.checkpoint import TrainState, list_checkpoints, load_checkpoint, save_checkpoint
from trainer.experts import select_backend
from trainer.hf import hf_tensors, load_hf_state
from trainer.model.transformer import Transformer, build_model
from trainer.optim import Optimizer
from trainer.pretrain import resolve_device
from trainer.report import build_rows, format_table, held_out_scores, save_png, wait_for_eval, wait_for_evals
from trainer.rl.advantages import group_advantages, zero_variance_groups
from trainer.rl.loss import ppo_loss

log = logging.getLogger(__name__)
T = TypeVar("T")

# How often a generation request that found no worker (all restarting) tries again.
_NO_WORKER_RETRY_S = 1.0
# How long a stopping trainer waits for its training thread to notice.
STOP_TIMEOUT_S = 20.0


class StopRequested(RuntimeError):
    """The role was told to stop (SIGTERM) while training."""


@dataclass
class Rollout:
    """One sample of one prompt: the generation with its behaviour log-probs, and its reward."""

    sample: Sample
    reward: float
    text: str

    @property
    def weight_versions(self) -> list[int]:
        return self.sample.versions


class _Generator:
    """The genable: one sample of one prompt through the router, rewarded by the task.

    It lives on the controller's event loop (its HTTP session and Redis client are created there on
    first use). When no worker can serve (every worker restarting), it waits for one, bounded by
    `rollout.startup_timeout_s`, instead of burning the error budget.
    """

    def __init__(self, cfg: Config, ctx: RunContext, task: Task, tokenizer: Any) -> None:
        self.cfg, self.ctx, self.task, self.tokenizer = cfg, ctx, task, tokenizer
        self._client: RolloutClient | None = None
        self._encoded: dict[str, list[int]] = {}

    def encode(self, text: str) -> list[int]:
        ids = self._encoded.get(text)
        if ids is None:
            ids = self._encoded[text] = list(self.tokenizer(text)["input_ids"])
        return ids

    async def __call__(self, req: SampleRequest) -> Rollout:
        if self._client is None:
            self._client = RolloutClient(
                self.cfg.rollout.served_model_name,
                redis_client=self.ctx.async_redis(),
                keys=self.ctx.keys,
                router_name=self.cfg.router.name,
                affinity_header=self.cfg.router.affinity_header,
            )
        problem: Problem = req.prompt
        ro = self.cfg.rollout
        deadline = time.monotonic() + ro.startup_timeout_s
        while True:
            try:
                (sample,) = await self._client.generate(
                    self.encode(problem.prompt),
                    temperature=ro.temperature,
                    top_p=ro.top_p,
                    max_tokens=ro.max_tokens,
                    group=f"{self.ctx.exp}:{req.prompt_id}",
                )
                break
            except (NoRouterError, RolloutError, aiohttp.ClientConnectionError) as exc:
                if not _no_worker(exc) or time.monotonic() > deadline:
                    raise
                await asyncio.sleep(_NO_WORKER_RETRY_S)
        if sample.aborted:
            raise RolloutError(f"sample {req.prompt_id}/{req.index} was aborted by a weight update")
        text = self.tokenizer.decode(sample.token_ids, skip_special_tokens=True)
        reward = await asyncio.to_thread(self.task.reward, problem, text)
        return Rollout(sample, reward, text)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            if self._client.redis is not None:
                await self._client.redis.aclose()


def _no_worker(exc: BaseException) -> bool:
    """True for failures that mean "no worker right now": no router, the router's 503 (no healthy
    worker) or 502 (the worker's connection failed), a refused connection to the router."""
    if isinstance(exc, (NoRouterError, aiohttp.ClientConnectionError)):
        return True
    return isinstance(exc, RolloutError) and exc.status in (502, 503)


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


class RLTrainer:
    """The trainer of one RL run; `run()` does the whole run and returns the exit code."""

    def __init__(self, ctx: RunContext, io_loop: asyncio.AbstractEventLoop) -> None:
        self.ctx, self.cfg = ctx, ctx.cfg
        self.io_loop = io_loop  # the role's event loop, idle while this thread trains: runs publishes
        self.device = resolve_device(self.cfg.trainer.device)
        self.task = load_task(self.cfg.rollout.task)
        self.model_dir = resolve_model(self.cfg, ctx.run_dir)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.model = self._initial_model()
        self.optimizer = Optimizer(self.model, self.cfg.trainer.optim)
        self.state = TrainState()
        self.metrics = MetricsWriter(ctx.run_dir, ctx.exp, "trainer", 0)
        self.ckpt_root = ctx.run_dir / "checkpoints"
        self.audit = ctx.run_dir / "trained_prompts.jsonl"
        self.publisher = WeightPublisher(ctx.async_redis(), ctx.keys, self.cfg.rollout, ctx.run_dir)
        self.stop_requested = threading.Event()
        self.controller: GenerationController | None = None
        self._t0 = time.monotonic()
        self._samples_trained = 0

    # -- setup ---------------------------------------------------------------------------------

    def _initial_model(self) -> Transformer:
        tc = self.cfg.trainer
        dtype = torch.bfloat16 if tc.dtype == "bfloat16" else torch.float32
        backend = select_backend(tc.experts.backend, self.device, dtype)
        model = build_model(tc.model, backend, seed=None)
        # Version 0 must be the function the workers serve: start from their checkpoint unless told otherwise.
        load_hf_state(model, Path(tc.init) if tc.init else self.model_dir)
        return model.to(self.device)

    def stop(self) -> None:
        """Ask the run to end (from another thread): warm start checks the flag, the flow runtime's
        wait is ended by closing the generation controller."""
        self.stop_requested.set()
        if self.controller is not None:
            self.controller.close()

    def _io(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.io_loop).result()

    # -- warm start ----------------------------------------------------------------------------

    def warm_start(self) -> None:
        """Supervised steps on reference answers (prompt tokens masked out of the loss)."""
        w = self.cfg.trainer.warmup
        if w.steps <= 0:
            return
        optim = torch.optim.AdamW(self.model.parameters(), lr=w.lr, betas=(0.9, 0.95), weight_decay=0.0)
        eos = self.tokenizer.eos_token_id
        n = len(self.task)
        self.model.train()
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
            targets = torch.where(mask[:, 1:] > 0, tokens[:, 1:], torch.full_like(tokens[:, 1:], -100))
            logits = self.model(tokens[:, :-1].to(self.device))
            loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1).to(self.device))
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.trainer.optim.grad_clip or 1e9)
            optim.step()
            self.metrics.log("warmup/loss", step, float(loss.detach()))
            if step % 50 == 0 or step == w.steps - 1:
                log.info("warm start step %d/%d loss %.4f", step + 1, w.steps, float(loss.detach()))
        self.model.zero_grad(set_to_none=True)

    # -- flow callbacks (trainer thread) -------------------------------------------------------

    def train_step(self, step: int, groups: list[Group]) -> None:
        rl = self.cfg.trainer.rl
        t0 = time.perf_counter()
        rewards = torch.tensor([[r.reward for r in g.samples] for g in groups])
        advantages = group_advantages(rewards, rl.normalize_std)
        keep = ~zero_variance_groups(rewards) if rl.filter_zero_variance else torch.ones(len(groups), dtype=torch.bool)
        used = [(g, advantages[i]) for i, g in enumerate(groups) if keep[i]]
        rollouts = [r for g, _ in used for r in g.samples]
        # With no group carrying a signal the step trains nothing: version step + 1 has the same weights.
        stats = self._update(step, rollouts, torch.cat([a for _, a in used])) if rollouts else {}
        self.state.step = step + 1
        all_rollouts = [r for g in groups for r in g.samples]
        accuracy = sum(r.reward >= 1.0 for r in all_rollouts) / len(all_rollouts)
        staleness = [step - min(r.weight_versions) for r in all_rollouts]
        self._samples_trained += len(all_rollouts)
        reward_mean = float(rewards.mean())
        figures = {
            "rl/reward_mean": reward_mean,
            "rl/accuracy": accuracy,
            "rl/groups_used": len(used),
            "rl/completion_tokens_mean": sum(len(r.sample.token_ids) for r in all_rollouts) / len(all_rollouts),
            "rl/staleness_mean": sum(staleness) / len(staleness),
            "rl/staleness_max": max(staleness),
            "perf/step_s": time.perf_counter() - t0,
            "perf/samples_per_s": self._samples_trained / (time.monotonic() - self._t0),
            **{f"loss/{k}": v for k, v in stats.items()},
        }
        self.metrics.log_many(step, figures)
        with self.audit.open("a") as fh:
            fh.write(json.dumps({"step": step, "prompt_ids": [g.prompt_id for g in groups]}) + "\n")
        log.info(
            "step %d: reward %.3f accuracy %.3f groups %d/%d staleness<=%d %s",
            step, reward_mean, accuracy, len(used), len(groups), max(staleness),
            " ".join(f"{k}={v:.4g}" for k, v in stats.items() if k in ("loss", "clip_fraction", "iw_mean")),
        )  # fmt: skip

    def _update(self, step: int, rollouts: list[Rollout], advantages: torch.Tensor) -> dict[str, float]:
        """One optimizer step on the decoupled PPO loss; returns the loss statistics."""
        rl = self.cfg.trainer.rl
        tokens, targets, behaviour, mask = padded_batch(rollouts, self.tokenizer.pad_token_id)
        tokens, targets, behaviour, mask = (t.to(self.device) for t in (tokens, targets, behaviour, mask))
        advantages = advantages.to(self.device)
        mb = rl.micro_batch_samples
        chunks = [slice(i, i + mb) for i in range(0, len(rollouts), mb)]
        with torch.no_grad():
            self.model.eval()
            proximal = torch.cat([self.model.token_logprobs(tokens[c], targets[c]) for c in chunks])
        self.model.train()
        total = float(mask.sum()) if rl.aggregation == "token_mean" else float(len(rollouts))
        sums: dict[str, float] = {}
        for c in chunks:
            logp = self.model.token_logprobs(tokens[c], targets[c])
            out = ppo_loss(logp, proximal[c], behaviour[c], advantages[c], mask[c], rl, total=total)
            out.loss.backward()
            weight = float(mask[c].sum()) / float(mask.sum())
            for k, v in out.stats.items():
                sums[k] = sums.get(k, 0.0) + (v if k in ("loss", "pg_loss", "kl", "tokens") else v * weight)
        step_stats = self.optimizer.step(int(mask.sum()))
        sums["grad_norm"] = step_stats.grad_norm
        # On samples made entirely by the current weights (version `step`), behaviour and proximal
        # log-probs come from the same function: their gap is the trainer-vs-vLLM numerical mismatch.
        fresh = torch.tensor([all(v == step for v in r.weight_versions) for r in rollouts], device=mask.device)
        fresh_mask = mask * fresh.unsqueeze(1)
        if fresh_mask.sum() > 0:
            sums["fresh_logprob_mismatch"] = float(((proximal - behaviour).abs() * fresh_mask).sum() / fresh_mask.sum())
        return sums

    def _hf_state(self) -> dict[str, torch.Tensor]:
        """The policy's tensors in HF naming, on the CPU (what a publish writes)."""
        return {name: t.detach().to("cpu") for name, t in hf_tensors(self.model)}

    def publish(self, version: int) -> None:
        result = self._io(self.publisher.publish(version, self._hf_state()))
        self.metrics.log_many(version, {"weights/publish_s": result.total_s, "weights/max_pause_s": result.max_pause_s,
                                        "weights/write_s": result.write_s, "weights/max_load_s": result.max_load_s})  # fmt: skip

    def checkpoint(self, next_step: int, flow_state: dict[str, Any]) -> None:
        interval = self.cfg.trainer.checkpoint.interval_steps
        if interval and next_step % interval == 0:
            self.save(flow_state)

    def save(self, flow_state: dict[str, Any]) -> Path:
        self.state.tokens = self.optimizer.tokens
        self.state.flow_state = flow_state
        path = save_checkpoint(self.ckpt_root, self.model, self.optimizer, self.state, self.cfg,
                               keep=self.cfg.trainer.checkpoint.keep)  # fmt: skip
        log.info("checkpoint %s", path)
        return path

    # -- the run -------------------------------------------------------------------------------

    def run(self) -> int:
        tc, flow = self.cfg.trainer, self.cfg.flow
        resumed = False
        if tc.checkpoint.resume and list_checkpoints(self.ckpt_root):
            latest = list_checkpoints(self.ckpt_root)[-1]
            self.state = load_checkpoint(latest, self.model, self.optimizer, self.cfg)
            resumed = True
            log.info("resumed from %s at step %d", latest, self.state.step)
        else:
            self.warm_start()
        published = self._io(current_version(self.publisher.client, self.ctx.keys))
        if published != self.state.step:
            # Version `step` is what the trainer holds; the workers must serve exactly it.
            self._io(self.publisher.publish(self.state.step, self._hf_state(), force=True))
        policy = FlowPolicy.from_config(flow, num_prompts=len(self.task), max_steps=tc.steps)
        generator = _Generator(self.cfg, self.ctx, self.task, self.tokenizer)
        controller = self.controller = GenerationController.from_config(generator, flow, name="rollout")
        if self.stop_requested.is_set():
            controller.close()
        controller.set_tqdm(disabled=False, total=None, desc="samples")
        runtime = FlowRuntime(
            policy, controller, lambda i: self.task.problem(i) if i < len(self.task) else None,
            self.train_step, self.publish, checkpoint=self.checkpoint,
        )  # fmt: skip
        if resumed and self.state.flow_state:
            runtime.load_state_dict(self.state.flow_state)
        try:
            report = runtime.run()
        except ControllerClosed:
            if self.stop_requested.is_set():
                raise StopRequested("stopped while training") from None
            raise
        finally:
            with contextlib.suppress(ControllerClosed):
                controller.run_coroutine(generator.close()).result(timeout=10)
            controller.close()
        self.save(runtime.state_dict())
        c = report.counters
        log.info("flow finished: %s; counters %s", report.finish_reason, c)
        self.metrics.log_many(self.state.step, {f"flow/{k}": float(v) for k, v in vars(c).items()
                                                if isinstance(v, (int, float))})  # fmt: skip
        # The prompt ledger: every admitted prompt is trained (see trained_prompts.jsonl), still
        # untrained in the saved flow state, or dropped (counted).
        summary = {
            "finish_reason": report.finish_reason,
            "admitted_prompts": policy.next_prompt,
            "untrained_prompts": sorted(policy.untrained),
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
        last = self.state.step - self.state.step % ev.every_n_versions
        if benchmark and evaluator_alive:
            log.info("waiting up to %.0fs for the evaluator's %s result of version %d", self.cfg.trainer.final_eval_wait_s,
                     benchmark, last)  # fmt: skip
            deadline = time.monotonic() + self.cfg.trainer.final_eval_wait_s
            if not wait_for_eval(client, self.ctx.keys, last, benchmark, self.cfg.trainer.final_eval_wait_s):
                log.warning("no %s result for version %d yet; the table shows what was evaluated", benchmark, last)
            elif client.hlen(self.ctx.keys.eval_workers):
                # A pinning evaluator measures every due version, newest first, then backfills the older ones.
                due = set(range(0, last + 1, ev.every_n_versions))
                missing = wait_for_evals(client, self.ctx.keys, due, benchmark, max(0.0, deadline - time.monotonic()))
                if missing:
                    log.warning("no %s result yet for version(s) %s; the table shows what was evaluated", benchmark,
                                sorted(missing))  # fmt: skip
        heldout = held_out_scores(client, self.ctx.keys, benchmark) if benchmark else {}
        rows = build_rows(self.ctx.run_dir, heldout)
        print(format_table(rows, every=max(1, len(rows) // 20)), flush=True)
        png = save_png(rows, self.ctx.run_dir / "report.png", f"{self.ctx.exp}: {self.cfg.flow.strategy}")
        if heldout:
            first, final = min(heldout), max(heldout)
            log.info("held-out %s: %.3f at version %d -> %.3f at version %d (%+.1f points)", benchmark,
                     heldout[first], first, heldout[final], final, 100 * (heldout[final] - heldout[first]))  # fmt: skip
        log.info("report: %s; metrics: %s", png, self.ctx.run_dir / "metrics")


async def main(ctx: RunContext) -> int:
    """ROLE=trainer: the RL run, in a thread (training blocks), with this loop serving its publishes.

    A thread cannot be cancelled: on SIGTERM the trainer is told to stop (its generation controller
    closes, which ends the flow runtime's wait), and the role waits a bounded time for the thread.
    """
    trainer = RLTrainer(ctx, asyncio.get_running_loop())
    work = asyncio.ensure_future(asyncio.to_thread(trainer.run))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        trainer.stop()
        done, _ = await asyncio.wait({work}, timeout=STOP_TIMEOUT_S)
        if not done:
            log.error("the training thread did not stop within %.0fs", STOP_TIMEOUT_S)
        raise
