"""The trainer role (`ROLE=trainer`) on each of its W ranks: form the group, then RLVR (rank 0 leads
through trainer/rl/driver.py, the others follow its commands, trainer/commands.py) or, with
trainer.mode = "pretrain", next-token pretraining (trainer/pretrain.py) on every rank.

Training runs in a daemon thread while the role's event loop serves rank 0's publishes and watches the
other ranks' liveness: a rank whose peer died names it and exits non-zero at once (its thread may be
blocked in a collective with the dead rank), and SIGTERM stops the trainer within a bound.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import torch

from common.aio import cancel_and_join
from common.config import Config
from common.metric_sinks import open_metrics
from common.net import advertised
from common.roles import RunContext
from trainer.commands import TrainerRank
from trainer.data.shards import data_root
from trainer.data.tokenizer import data_tokenizer
from trainer.hf_run import config_for_hf_model, refuse_quantized_rollout_model
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
from trainer.rl.driver import RLTrainer
from trainer.setup import resolve_device
from trainer.tinykit import resolve_model

log = logging.getLogger(__name__)

# How long a stopping trainer waits for its training thread to notice (it is a daemon thread: the role
# exits after this even if the thread is inside a long step; an unfinished checkpoint is never loaded).
STOP_TIMEOUT_S = 5.0
# How often a rank looks at the other ranks' liveness.
RANK_POLL_S = 0.5
# How long a rank whose collective failed waits for the watch to say which rank died.
DEAD_RANK_GRACE_S = 3.0


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
    A stop on SIGTERM closes the generation controller, whose progress bar takes tqdm's process-wide lock; a
    lock that is never released would hang the stop for good, so the stop must not hold the role's exit."""
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
    # A model from an HF directory: its config.json shapes the trainer's model (trainer/hf_run.py).
    refuse_quantized_rollout_model(ctx.cfg)
    ctx.cfg = config_for_hf_model(ctx.cfg)
    info = rank_info(os.environ)
    device = _device(ctx.cfg, info)
    client = ctx.redis
    store = RedisStoreAddress(client, ctx.keys.trainer_store)
    ranks = await asyncio.to_thread(
        form_group,
        info,
        device,
        store,
        BOOTSTRAP_TIMEOUT_S,
        _store_host(ctx),
        ctx.cfg.trainer.parallel.command_timeout_s,
    )
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
        both: set[asyncio.Future[Any]] = {work, watch}
        done, _ = await asyncio.wait(both, return_when=asyncio.FIRST_COMPLETED)
        if work in done and work.exception() is None:
            client.hset(ctx.keys.trainer_ranks, str(ranks.rank), json.dumps({**record, "state": "done"}))
            return work.result()
        if work in done:
            # A collective with a dead rank fails at once; the watch names the rank soon after.
            await asyncio.wait({watch}, timeout=DEAD_RANK_GRACE_S)
        if watch.done():
            log.error("%s; stopping trainer rank %d", watch.result(), ranks.rank)
            return 1
        return work.result()  # raises the training thread's error
    except asyncio.CancelledError:
        stopping.set()
        if trainer is not None:
            stop_within(trainer.stop, STOP_TIMEOUT_S)
        stopped, _ = await asyncio.wait({work}, timeout=STOP_TIMEOUT_S)
        if not stopped:
            log.error("the training thread did not stop within %.0fs", STOP_TIMEOUT_S)
        raise
    finally:
        # Cancelled again until it ends (common/aio.py): a watch whose cancel was lost would keep the rank alive.
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
    with open_metrics(cfg, ctx.run_dir, ctx.exp, "trainer", ranks.rank) as metrics:
        Pretrainer(cfg, data, ctx.run_dir, metrics, ranks=ranks).run()
    return 0
