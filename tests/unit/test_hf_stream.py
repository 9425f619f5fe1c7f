"""Streaming, per-rank HF import (trainer/hf_stream.py) through the trainer's own path (trainer/setup.py
starting_model, then the training core shards the experts and runs the loader): two real processes (gloo,
expert parallelism 2) read disjoint halves of the expert entries, every entry they need, and each one's
peak resident memory grows during the load by less than the checkpoint's size (its shard plus one entry)."""

import json
import os
import re
import sys
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors import safe_open
from safetensors.torch import save_file

from common.config import Config, ModelConfig
from trainer.core import TrainingCore
from trainer.hf import HFFormatError, export_fresh_hf, hf_tensors, import_hf
from trainer.hf_stream import SafetensorsFile, stream_hf_state
from trainer.model import build_model
from trainer.ranks import RankInfo, Ranks
from trainer.setup import starting_model

# 3 MoE layers x 64 experts x 3 x 128 x 256 fp32 = 75.5 MB of experts (6 MB dense): large enough that a rank
# holding the whole checkpoint would stand out from what building any model costs (about 14 MB here on top of
# the weights: allocator arenas, the process groups of the plan).
BIG = replace(
    ModelConfig(),
    hidden_size=128,
    moe_intermediate_size=256,
    n_routed_experts=64,
    num_layers=4,
    first_k_dense=1,
    n_shared_experts=1,
)


def _rss() -> int:
    return psutil.Process().memory_info().rss


def _reset_peak_rss() -> None:
    """Start the kernel's resident high-water mark (VmHWM) afresh from the current RSS (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def _peak_rss() -> int:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024


def _load_on_rank(rank: int, world: int, store: str, ckpt: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    cfg = Config()
    cfg.trainer.model = BIG
    cfg.trainer.parallel.ep = world
    cfg.trainer.init = ckpt
    _reset_peak_rss()
    record: dict = {"rss_start": _rss()}
    model, load = starting_model(cfg, torch.device("cpu"))
    assert load is not None

    def measured_load(m):
        record["peak_to_shard"] = _peak_rss()
        _reset_peak_rss()
        record["rss_before"] = _rss()
        report = load(m)
        record["peak_load"] = _peak_rss()
        record["read"], record["skipped"], record["bytes_read"] = report.read, report.skipped, report.bytes_read

    ranks = Ranks(RankInfo(rank, world, rank, "launcher"), torch.device("cpu"), dist.group.WORLD)
    core = TrainingCore(cfg, ranks, model, measured_load)
    # What this rank holds equals the checkpoint's entries under the same names.
    with safe_open(str(Path(ckpt) / "model.safetensors"), framework="pt") as st:
        record["mismatched"] = [n for n, t in hf_tensors(core.model) if not torch.equal(t, st.get_tensor(n))]
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as test_ep_dist: leave without gloo's destructors racing the peer's


def test_two_ranks_read_disjoint_experts_below_checkpoint_size(tmp_path):
    ckpt = export_fresh_hf(BIG, seed=3, out_dir=tmp_path / "ckpt")
    size = (ckpt / "model.safetensors").stat().st_size
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as st:
        names = set(st.keys())
    experts = {n for n in names if ".mlp.experts." in n}
    mp.spawn(_load_on_rank, args=(2, str(tmp_path / "store"), str(ckpt), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    read = [{n for n in r["read"] if n in experts} for r in ranks]
    assert read[0] and read[1] and not read[0] & read[1]
    assert read[0] | read[1] == experts
    for r in ranks:
        assert set(r["read"]) - experts == names - experts  # the dense part on every rank
        assert set(r["skipped"]) == experts - set(r["read"])
        assert r["mismatched"] == []
    # From before the model is built to the end of the load: the model's shard plus what the load needs.
    total = [max(r["peak_to_shard"], r["peak_load"]) - r["rss_start"] for r in ranks]
    # The load alone: the pages of the shard it fills (allocated untouched by the sharding), plus an entry.
    during = [r["peak_load"] - r["rss_before"] for r in ranks]
    print(
        f"checkpoint {size / 1e6:.1f} MB; per rank: read {[r['bytes_read'] / 1e6 for r in ranks]} MB, peak RSS "
        f"growth build+shard+load {[t / 1e6 for t in total]} MB, during the load {[d / 1e6 for d in during]} MB"
    )
    for t, d, r in zip(total, during, ranks, strict=True):
        assert t < size  # its half of the experts plus the dense part, not the checkpoint
        assert d < r["bytes_read"] + 4e6  # what it read, one entry at a time (the largest is 0.4 MB)


def test_reader_matches_safetensors(tmp_path):
    tensors = {
        "a": torch.randn(5, 3),
        "b": torch.randn(4, 2, 3).to(torch.bfloat16),
        "c": torch.arange(7, dtype=torch.int64),
        "d": torch.randn(6, 4).to(torch.float8_e4m3fn),
    }
    save_file(tensors, str(tmp_path / "x.safetensors"))
    with SafetensorsFile(tmp_path / "x.safetensors") as st:
        for name, t in tensors.items():
            assert torch.equal(st.read(name).view(torch.uint8), t.view(torch.uint8)), name
        assert torch.equal(st.read_rows("b", 1, 3), tensors["b"][1:3])


def test_stacked_layout_and_single_rank_equal_the_model(tmp_path):
    """transformers' own stacked expert layout reads as the per-expert one; the imported model's tensors
    are the exported ones."""
    src = build_model(replace(ModelConfig(), num_layers=3), seed=5)
    stacked = {n: t.contiguous() for n, t in src.state_dict().items()}
    stacked.pop("lm_head.weight") if src.cfg.tie_word_embeddings else None
    save_file(stacked, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    dst = build_model(src.cfg, seed=None)
    report = stream_hf_state(dst, tmp_path)
    assert report.skipped == []
    for name, t in src.state_dict().items():
        assert torch.equal(dst.state_dict()[name], t), name
    per_expert = export_fresh_hf(src.cfg, seed=5, out_dir=tmp_path / "hf")
    again = import_hf(per_expert)
    for name, t in src.state_dict().items():
        assert torch.equal(again.state_dict()[name], t), name


def test_unknown_expert_number_is_refused(tmp_path):
    cfg = ModelConfig()
    model = build_model(cfg, seed=0)
    tensors = dict(hf_tensors(model))
    tensors[f"model.layers.1.mlp.experts.{cfg.n_routed_experts}.down_proj.weight"] = torch.zeros(1)
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp_path / "model.safetensors"))
    with pytest.raises(HFFormatError, match=rf"unexpected.*experts\.{cfg.n_routed_experts}\.down_proj"):
        stream_hf_state(build_model(cfg, seed=None), tmp_path)
