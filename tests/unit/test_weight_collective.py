"""The `collective` transport (common/weights/collective.py, group.py) without a vLLM server: a publisher over
real Redis and two trainer ranks (rank 0 and one peer in a thread, each broadcasting its own shards through a real
gloo group over loopback) send whole versions and deltas to two workers that receive with the `file` engine's real
reader (tests/support/rl_routes.py stands in for the vLLM server around it); every shard comes through the groups
and every tensor ends bit for bit the published one, while the version is committed as files too; a worker that
fails before joining is evicted and calls the groups off, so the others read the version from the files without
waiting for it; a shard whose bytes miss their CRC-32 is refused."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import pytest
import torch

from common.config import RolloutConfig
from common.keys import Keys
from common.weights.delta import DeltaEncoder, HeldWeights
from common.weights.group import GroupSpec, ShardCaster
from common.weights.index import PartReport, delta_base
from common.weights.publisher import WeightPublisher
from common.weights.writer import VersionPart, count_shards
from tests.support.rl_routes import reading_worker, register
from tests.unit.test_weight_delta import model, same_bits, step

MB = 1 << 20


class CastingPeer:
    """`PeerWriters` of one more trainer rank, in a thread of this process: it writes its part as trainer/commands.py
    `write_part` does, each shard broadcast into its own group first when the publish names one."""

    def __init__(self, part: dict[str, torch.Tensor], shard_bytes: int) -> None:
        self.part, self.shard_bytes = part, shard_bytes
        self.shard_counts = [count_shards(part, shard_bytes)]
        self.encoder = DeltaEncoder()
        self.casters: list[ShardCaster] = []

    def write(
        self, tmp: Path, first_shard: list[int], total_shards: int, base: int | None, group: GroupSpec | None = None
    ) -> list[PartReport]:
        caster = ShardCaster(group, 1) if group is not None else None
        if caster is not None:
            self.casters.append(caster)
        version = int(tmp.name.split(".")[1][1:])
        part = VersionPart(
            tmp,
            version,
            self.part,
            self.shard_bytes,
            first_shard[0],
            total_shards,
            self.encoder,
            base,
            None if caster is None else caster.send,
        )
        try:
            return [part.write()]
        finally:
            if caster is not None:
                caster.close()


def split(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Rank 0's part (the dense tensors) and rank 1's (the experts)."""
    experts = {n: t for n, t in tensors.items() if ".experts." in n}
    return {n: t for n, t in tensors.items() if n not in experts}, experts


def bigger_model(seed: int) -> dict[str, torch.Tensor]:
    """model() with more experts, so that each rank writes several 1 MB shards."""
    tensors = model(seed)
    g = torch.Generator().manual_seed(seed + 100)
    for e in range(1, 6):
        tensors[f"layers.0.mlp.experts.{e}.up_proj.weight"] = (torch.randn(1024, 512, generator=g) * 0.02).bfloat16()
    return tensors


@pytest.mark.timeout(120)
async def test_two_trainer_ranks_send_whole_versions_and_deltas_through_the_groups_bit_for_bit(
    tmp_path: Path, redis_client, caplog
):
    r, keys = redis_client, Keys("collective")
    caplog.set_level(logging.WARNING)
    got = [{}, {}]
    helds = [HeldWeights(), HeldWeights()]
    reads: list[list] = [[], []]
    workers = [await reading_worker(got[i], held=helds[i], reads=reads[i]) for i in range(2)]
    cfg = RolloutConfig(
        weight_backend="collective", keep_versions=2, weight_delta=True, weight_snapshot_every=3, weight_shard_mb=1
    )
    try:
        for i, (_, url) in enumerate(workers):
            await register(r, keys, f"w{i}", url)
        tensors = bigger_model(0)
        dense, experts = split(tensors)
        peer = CastingPeer(experts, MB)
        async with WeightPublisher(r, keys, cfg, tmp_path) as pub:
            assert pub.transport.backend == "collective"
            for version in range(1, 5):
                tensors = step(tensors, seed=version)
                dense, experts = split(tensors)
                for name, t in experts.items():  # the peer's part is the tensors it holds, changed in place
                    peer.part[name].copy_(t)
                result = await pub.publish(version, dense, peers=peer)
                assert [w.ok for w in result.workers] == [True, True], result.workers
                for i in range(2):
                    same_bits(got[i], tensors)
                    update = reads[i][-1]
                    assert update.group is not None and update.received == update.shards == result.shards
                    assert helds[i].version == version
                assert result.streamed and result.delta_base == (None if version % 3 == 1 else version - 1)
                # The version is committed as files too (late workers, the evaluator and republishing read them).
                assert delta_base(Path(result.location)) == result.delta_base
            assert result.shards >= 4 and all(c.error is None and c.sent >= 2 for c in peer.casters)
        assert not [rec for rec in caplog.records if "broke" in rec.getMessage()], caplog.text
    finally:
        for runner, _ in workers:
            await runner.cleanup()


@pytest.mark.timeout(120)
async def test_a_worker_that_fails_before_joining_is_evicted_and_calls_the_groups_off_the_others_read_the_files(
    tmp_path: Path, redis_client
):
    r, keys = redis_client, Keys("collective-fail")
    got: dict = {}
    reads: list = []
    good, good_url = await reading_worker(got, reads=reads)

    def refuse(info: dict) -> None:
        raise RuntimeError("this worker fails before it joins the weight groups")

    bad, bad_url = await reading_worker({}, on_update=refuse)
    cfg = RolloutConfig(weight_backend="collective", weight_group_timeout_s=30.0, weight_shard_mb=1)
    try:
        await register(r, keys, "good", good_url)
        await register(r, keys, "bad", bad_url)
        tensors = bigger_model(1)
        async with WeightPublisher(r, keys, cfg, tmp_path) as pub:
            t0 = time.monotonic()
            result = await pub.publish(1, tensors)
            took = time.monotonic() - t0
        assert {w.worker_id: w.ok for w in result.workers} == {"good": True, "bad": False}
        same_bits(got, tensors)
        assert reads[0].received == 0 and reads[0].shards == result.shards
        # The failed worker called the groups off: nobody waited the 30 s for it to join.
        assert took < 10.0, took
        assert threading.active_count() < 50
    finally:
        await good.cleanup()
        await bad.cleanup()


def test_the_config_refuses_the_collective_transport_with_tensor_parallel_workers_naming_why():
    from common.config import load_config
    from common.config.coerce import ConfigError

    cfg = load_config("configs/demo.toml", ["rollout.weight_backend=collective"])
    assert cfg.rollout.weight_backend == "collective"
    with pytest.raises(ConfigError, match="tensor_parallel_size = 2.*rank of its own in the weight groups"):
        load_config("configs/demo.toml", ["rollout.weight_backend=collective", "rollout.tensor_parallel_size=2"])


def test_a_shard_whose_bytes_do_not_match_the_crc_its_sender_sent_is_refused_naming_it():
    """The wire itself (group.py) over a real gloo group of two threads: a sender that announces a wrong CRC-32
    (bytes changed in transit look the same to the receiver) gets its shard refused, the shard named; the store
    the groups meet on listens on its address only."""
    import zlib

    from common.weights.group import GroupShardError, _broadcast, join, receive_shards, serve_store

    store = serve_store("127.0.0.1", 10.0)
    # The weight groups' store listens on the address it was given only, not on every interface.
    import psutil

    listening = {
        c.laddr.ip for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == store.port
    }
    assert listening == {"127.0.0.1"}, listening
    spec = GroupSpec("127.0.0.1", store.port, "crc", 2, 10.0)
    data = b"shard bytes" * 100

    def bad_sender() -> None:
        pg = join(spec, 0, 0, store)
        _broadcast(pg, torch.tensor([7, len(data), zlib.crc32(data) ^ 1], dtype=torch.int64))
        _broadcast(pg, torch.frombuffer(bytearray(data), dtype=torch.uint8))

    sender = threading.Thread(target=bad_sender)
    sender.start()
    with pytest.raises(GroupShardError, match=r"shard 7 from trainer rank 0 .* with CRC-32"):
        list(receive_shards(spec, 1, [[7]]))
    sender.join(10)
    assert not sender.is_alive()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["file", "collective"])
async def test_a_worker_that_registers_while_a_version_is_sent_serves_it_before_the_publish_returns(
    tmp_path: Path, redis_client, backend
):
    """A restarted or readmitted worker catches up to weights:current (the version before) and registers after the
    publish chose its workers; the publish brings it to the new version from the files before it returns (the next
    batch is generated right after: on-policy refuses samples of the version before)."""
    import asyncio

    r, keys = redis_client, Keys(f"late-{backend}")
    got_late: dict = {}
    late, late_url = await reading_worker(got_late)
    registered = []

    def register_the_late_one(info: dict) -> None:
        registered.append(asyncio.run_coroutine_threadsafe(register(r, keys, "late", late_url), loop))

    loop = asyncio.get_running_loop()
    first, first_url = await reading_worker({}, on_update=register_the_late_one)
    cfg = RolloutConfig(weight_backend=backend, weight_shard_mb=1)
    try:
        await register(r, keys, "first", first_url)
        tensors = bigger_model(2)
        async with WeightPublisher(r, keys, cfg, tmp_path) as pub:
            result = await pub.publish(1, tensors)
        assert registered and registered[0].done()
        assert {w.worker_id: w.ok for w in result.workers} == {"first": True, "late": True}
        same_bits(got_late, tensors)
        records = json.loads(await r.hget(keys.workers, "late"))
        assert records["weight_version"] == 1
    finally:
        await late.cleanup()
        await first.cleanup()
