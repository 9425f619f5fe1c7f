"""Delta publishing (common/weights/delta.py) without a vLLM server: the codec is exact for every dtype a model
exports; a publisher with `rollout.weight_delta` writes whole snapshots and deltas on its schedule, over real
Redis, to workers that read with the `file` engine's real reader (tests/support/rl_routes.py stands in for the
vLLM server around it) and end with bit for bit the published tensors, holding the last version or not; a
delta whose base a reader does not hold is applied on the base rebuilt from disk; pruning keeps a kept version's
chain; a corrupted delta is refused naming the tensor; a rank that does not hold the base writes its part whole."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, save

from common.config import RolloutConfig
from common.keys import Keys
from common.weights.delta import DeltaDecoder, DeltaEncoder, DeltaError, HeldWeights, decode, encode, rebuild
from common.weights.index import DELTA_META_KEY, INDEX_NAME, delta_base, safetensors_metadata
from common.weights.publisher import WeightPublisher
from common.weights.writer import VersionPart, count_shards
from rollout.vllm_plugin.file_engine import FileUpdateInfo
from tests.support.rl_routes import reading_worker, register

MB = 1 << 20


def model(seed: int = 0) -> dict[str, torch.Tensor]:
    """A small model of the dtypes an export holds: bf16 matrices, an fp32 router bias, an int64 counter."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": (torch.randn(512, 64, generator=g) * 0.02).bfloat16(),
        "layers.0.mlp.experts.0.up_proj.weight": (torch.randn(256, 64, generator=g) * 0.02).bfloat16(),
        "layers.0.mlp.gate.e_score_correction_bias": torch.randn(8, generator=g),
        "steps": torch.tensor(3, dtype=torch.int64),
    }


def step(tensors: dict[str, torch.Tensor], seed: int, lr: float = 1e-4) -> dict[str, torch.Tensor]:
    """One optimizer-like step: every float moves by about lr (most bf16 weights by a unit in the last place)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in tensors.items():
        if t.is_floating_point():
            out[name] = (t.float() - lr * torch.randn(t.shape, generator=g).sign()).to(t.dtype)
        else:
            out[name] = t + 1
    return out


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(a[name].reshape(-1).view(torch.uint8), b[name].reshape(-1).view(torch.uint8)), name


def test_the_codec_gives_back_every_bit_for_each_dtype_and_is_small_when_little_changed():
    base = model()
    new = step(base, seed=1)
    for name in base:
        blob = encode(new[name], base[name])
        back = decode(blob, base[name])
        assert back.dtype == new[name].dtype and back.shape == new[name].shape
        assert torch.equal(back.reshape(-1).view(torch.uint8), new[name].reshape(-1).view(torch.uint8)), name
    full = base["embed.weight"].numel() * 2
    unchanged = len(encode(base["embed.weight"], base["embed.weight"]))
    tiny = len(encode(step(base, seed=2, lr=1e-6)["embed.weight"], base["embed.weight"]))
    moved = len(encode(new["embed.weight"], base["embed.weight"]))
    assert unchanged < 0.01 * full and tiny < 0.1 * full and moved < 0.6 * full, (unchanged, tiny, moved, full)


@pytest.mark.timeout(120)
async def test_a_delta_publisher_sends_snapshots_and_deltas_that_workers_rebuild_bit_for_bit(
    tmp_path: Path, redis_client
):
    """Two readers: one holds the last version between updates (as the engine does), one holds nothing and
    rebuilds each delta's base from the snapshot and deltas on disk (a worker that restarted)."""
    r, keys = redis_client, Keys("delta")
    got_held: dict[str, torch.Tensor] = {}
    got_cold: dict[str, torch.Tensor] = {}
    held = HeldWeights()
    w_held, url_held = await reading_worker(got_held, held=held)
    w_cold, url_cold = await reading_worker(got_cold)
    cfg = RolloutConfig(keep_versions=1, weight_delta=True, weight_snapshot_every=3, weight_shard_mb=1)
    try:
        await register(r, keys, "held", url_held)
        await register(r, keys, "cold", url_cold)
        tensors = model()
        sizes = {}
        async with WeightPublisher(r, keys, cfg, tmp_path) as pub:
            root = pub.root
            for version in range(1, 8):
                tensors = step(tensors, seed=version)
                result = await pub.publish(version, tensors)
                assert [w.ok for w in result.workers] == [True, True], result.workers
                same_bits(got_held, tensors)
                same_bits(got_cold, tensors)
                assert held.version == version
                sizes[version] = result.bytes
                # The chain of every kept version stays: the newest, and its snapshot and deltas.
                kept = sorted(int(p.name[1:]) for p in root.glob("v*"))
                assert kept == list(range(version - (version - 1) % 3, version + 1)), (version, kept)
        bases = {v: delta_base(root / f"v{v}") for v in kept}
        assert bases == {7: None}
        # Snapshots every third version: 1, 4, 7; the others are deltas of the one before.
        assert [v for v in sizes if v % 3 == 1] == [1, 4, 7]
        full = sum(t.numel() * t.element_size() for t in tensors.values())
        for v, size in sizes.items():
            assert (size == full) if v % 3 == 1 else (size < 0.7 * full), (v, size, full)
    finally:
        await w_held.cleanup()
        await w_cold.cleanup()


def _publish_chain(root: Path, versions: int) -> list[dict[str, torch.Tensor]]:
    """Versions 1..versions written as one snapshot and deltas by one rank (VersionPart, as rank 0 writes),
    committed with an index; the tensors of each."""
    from common.weights.writer import VersionWriter

    encoder = DeltaEncoder()
    tensors, out = model(), []
    for v in range(1, versions + 1):
        tensors = step(tensors, seed=v)
        writer = VersionWriter(root, v, tensors, MB, delta=encoder, base=None if v == 1 else v - 1)
        writer.write()
        writer.commit()
        out.append(tensors)
    return out


def test_a_reader_holding_another_version_rebuilds_the_base_and_a_corrupted_delta_is_refused_naming_the_tensor(
    tmp_path: Path,
):
    root = tmp_path / "weights"
    versions = _publish_chain(root, 4)
    assert [delta_base(root / f"v{v}") for v in range(1, 5)] == [None, 1, 2, 3]
    # Holding version 2: version 4 is a delta of 3, rebuilt from 2 by applying 3.
    held = HeldWeights(2, rebuild(root, 2, HeldWeights()))
    same_bits(held.tensors, versions[1])
    same_bits(dict(FileUpdateInfo(path=str(root / "v4")).tensors(held)), versions[3])
    assert held.version == 4
    same_bits(held.tensors, versions[3])

    # A delta with one flipped byte in an encoded tensor, and an index that vouches for the file (it was
    # corrupted before it was written): the tensor's own CRC-32 catches it, naming the tensor.
    bad_root = tmp_path / "bad"
    shutil.copytree(root, bad_root)
    (shard,) = (bad_root / "v4").glob("*.safetensors")
    data = shard.read_bytes()
    tensors, meta = load(data), safetensors_metadata(data)
    name = "embed.weight"
    assert json.loads(meta[DELTA_META_KEY])["tensors"][name]["enc"] == "xor-zstd"
    blob = tensors[name].clone()
    blob[len(blob) // 2] ^= 0x01
    tensors[name] = blob
    shard.write_bytes(save(tensors, metadata=meta))
    (bad_root / "v4" / INDEX_NAME).unlink()  # no shard checksum: the per-tensor one must catch it
    with pytest.raises(DeltaError, match=f"'{name}'"):
        list(FileUpdateInfo(path=str(bad_root / "v4")).tensors(HeldWeights()))
    # A chain missing a link says which directory is gone.
    shutil.rmtree(bad_root / "v2")
    with pytest.raises(DeltaError, match=r"v2, on its chain of deltas, is gone"):
        rebuild(bad_root, 3, HeldWeights())


def test_a_rank_that_does_not_hold_the_base_writes_its_part_whole(tmp_path: Path):
    tmp = tmp_path / "v"
    tmp.mkdir()
    part = model()
    encoder = DeltaEncoder()
    total = count_shards(part, MB)
    report = VersionPart(tmp, 5, part, MB, 0, total, encoder, base=4).write()
    assert report.delta_base is None and encoder.version == 5
    (shard,) = tmp.glob("*.safetensors")
    meta = json.loads(safetensors_metadata(shard.read_bytes())[DELTA_META_KEY])
    assert meta["base"] is None and {e["enc"] for e in meta["tensors"].values()} == {"raw"}
    # Its copy is its own: changing the tensors it was given does not change the next delta's base.
    before = {n: t.clone() for n, t in part.items()}
    for t in part.values():
        t.add_(1)
    same_bits(encoder.tensors, before)
    decoded = dict(DeltaDecoder(HeldWeights(), None).tensors("v5", meta, load(shard.read_bytes()).items()))
    same_bits(decoded, before)


def test_the_config_refuses_a_snapshot_interval_below_one_and_the_nccl_backend_naming_why():
    from common.config import load_config
    from common.config.coerce import ConfigError

    with pytest.raises(ConfigError, match="weight_snapshot_every must be >= 1"):
        load_config("configs/demo.toml", ["rollout.weight_delta=true", "rollout.weight_snapshot_every=0"])
    with pytest.raises(ConfigError, match="'nccl' cannot run yet.*use 'collective'.*or 'file'"):
        load_config("configs/demo.toml", ["rollout.weight_backend=nccl"])


def test_a_delta_of_a_version_written_whole_without_delta_metadata_rebuilds_from_it(tmp_path: Path):
    from common.weights.writer import VersionWriter, write_version

    root = tmp_path / "weights"
    first = model()
    write_version(root, 1, first, MB)  # no delta metadata: a version of a publisher without deltas
    encoder = DeltaEncoder()
    encoder.remember(1, first.items())
    second = step(first, seed=1)
    writer = VersionWriter(root, 2, second, MB, delta=encoder, base=1)
    writer.write()
    writer.commit()
    assert writer.delta_base == 1 == delta_base(root / "v2")
    same_bits(rebuild(root, 2, HeldWeights()), second)
    same_bits(dict(FileUpdateInfo(path=str(root / "v2")).tensors()), second)
