"""Streaming, per-rank import of an HF checkpoint directory: the safetensors files are read one after the
other, entry by entry, each entry copied into the model as soon as it is read, and under expert
parallelism a rank reads only the entries of the experts it holds (its block of the expert DTensor
shard). Peak memory of a rank is then its model shard plus one entry, not the checkpoint.

The files are read through their header and positioned reads (`SafetensorsFile`) rather than
safetensors' `safe_open`: `safe_open` maps the whole file, and every page an entry touches stays in the
process's resident set until the file is closed, so reading a rank's experts out of one large file would
grow its resident memory by all of them again on top of the copy in the model. A positioned read leaves
the bytes in the page cache only, which the kernel can drop.

Names follow trainer/hf.py: our state dict uses HF's names, except the routed experts, stacked in our
model (gate_up_proj [E, 2I, H], down_proj [E, H, I]) and one entry per expert and projection in released
checkpoints; transformers' own stacked layout is read too (this rank's rows of it only)."""

from __future__ import annotations

import json
import logging
import os
import re
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from trainer import hf_mixtral
from trainer.hf_errors import HFFormatError
from trainer.hf_fp8 import SCALE_SUFFIX, FP8FormatError, check_quantization_config, dequantize_entry, off_recipe_blocks
from trainer.model import Transformer
from trainer.model.moe import ExpertWeights, refresh_expert_weight_copies

log = logging.getLogger(__name__)

EXPERT_ENTRY = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
STACKED_ENTRY = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")

# safetensors dtype codes (the format's header) -> torch dtypes.
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: where its bytes are and what they hold."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    """Offset of its first byte in the file."""
    nbytes: int


class SafetensorsFile:
    """One safetensors file read through its header and positioned reads: `read` returns one entry,
    `read_rows` the rows [start, stop) of its first dimension, each in freshly allocated memory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise HFFormatError(f"{path}: shorter than a safetensors header")
            (size,) = struct.unpack("<Q", raw)
            header = json.loads(f.read(size))
        base = 8 + size
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.entries: dict[str, Entry] = {}
        for name, info in header.items():
            if info["dtype"] not in SAFETENSORS_DTYPES:
                raise HFFormatError(f"{path}: entry {name} has dtype {info['dtype']}, which we cannot read")
            begin, end = info["data_offsets"]
            self.entries[name] = Entry(
                SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"]), base + begin, end - begin
            )
        self._fd = os.open(path, os.O_RDONLY)

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read(self, name: str) -> torch.Tensor:
        e = self.entries[name]
        return self._read(e.start, e.nbytes, e.dtype, e.shape)

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        e = self.entries[name]
        row = e.nbytes // e.shape[0]
        return self._read(e.start + start * row, (stop - start) * row, e.dtype, (stop - start, *e.shape[1:]))

    def _read(self, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        out = torch.empty(nbytes, dtype=torch.uint8)
        view = out.numpy().data
        done = 0
        while done < nbytes:
            n = os.preadv(self._fd, [view[done:]], offset + done)
            if n == 0:
                raise HFFormatError(f"{self.path}: ends inside an entry (byte {offset + done} of {nbytes} wanted)")
            done += n
        return out.view(dtype).reshape(shape)


@dataclass
class StreamReport:
    """What one streamed import read."""

    read: list[str] = field(default_factory=list)
    """The entries read, in reading order."""
    skipped: list[str] = field(default_factory=list)
    """The expert entries of other ranks, not read."""
    bytes_read: int = 0


def place_without_experts(model: Transformer, device: torch.device) -> Transformer:
    """`model` with its routed experts on the meta device (no memory anywhere) and everything else moved to
    `device`: what a streamed import starts from. Expert parallelism then allocates only this rank's block of
    experts (trainer/ep ShardedExperts), and `stream_hf_state` all of them where nothing sharded them. (The
    model's own `.to` cannot do it: it copies every tensor, and it cannot copy out of the meta device.)"""
    for mod in model.modules():
        if isinstance(mod, ExpertWeights):
            mod.to("meta")
            continue
        for p in mod.parameters(recurse=False):
            p.data = p.data.to(device)  # in place, as Module.to: tied weights stay one tensor
        for name, b in mod.named_buffers(recurse=False):
            setattr(mod, name, b.to(device))
    return model


def _materialize_experts(model: Transformer) -> None:
    """Allocate (uninitialised) the expert modules left on the meta device, beside the dense weights."""
    device = model.lm_head.weight.device
    for mod in model.modules():
        if isinstance(mod, ExpertWeights) and any(p.is_meta for p in mod.parameters(recurse=False)):
            mod.to_empty(device=device)


def owned_experts(model: Transformer) -> dict[str, range]:
    """Per MoE layer (the prefix `model.layers.L.mlp.experts`), the global expert numbers this rank holds: all
    of them unsharded, its block of the DTensor shard under expert parallelism (as trainer/hf.py hf_tensors)."""
    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, ExpertWeights):
            gate_up = mod.gate_up_proj
            if isinstance(gate_up, DTensor):
                local = gate_up.to_local().shape[0]
                first = gate_up.device_mesh.get_local_rank() * local
            else:
                first, local = 0, gate_up.shape[0]
            out[name] = range(first, first + local)
    return out


def _expert_views(model: Transformer) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per MoE layer prefix, this rank's (gate_up [El, 2I, H], down [El, H, I]) master tensors."""
    return {name: mod.masters() for name, mod in model.named_modules() if isinstance(mod, ExpertWeights)}


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise HFFormatError(f"tensor {name}: checkpoint shape {tuple(src.shape)} != model shape {tuple(dst.shape)}")
    dst.copy_(src.to(dst.dtype))


def checkpoint_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise HFFormatError(f"no *.safetensors files in {path}")
    return files


def _dense_targets(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's non-expert tensors by HF name (plain tensors: only the experts are sharded)."""
    experts = set(_expert_views(model))
    out = {}
    for name, t in model.state_dict().items():
        if name.rsplit(".", 1)[0] in experts:
            continue
        if model.cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        out[name] = t
    return out


def _expected_expert_entries(owned: dict[str, range]) -> Iterator[str]:
    for prefix, experts in owned.items():
        for e in experts:
            for proj in ("gate_proj", "up_proj", "down_proj"):
                yield f"{prefix}.{e}.{proj}.weight"


def quantization_of(path: Path) -> dict | None:
    """config.json's quantization_config (checked: only DeepSeek-V3's FP8 block layout), None without one."""
    cfg_file = path / "config.json"
    quant = json.loads(cfg_file.read_text()).get("quantization_config") if cfg_file.is_file() else None
    if quant is not None:
        check_quantization_config(quant)
    return quant


class _Checkpoint:
    """Every safetensors file of a directory, headers read, entries read on demand; e4m3 weights come back
    dequantized with their weight_scale_inv, which may sit in another file (trainer/hf_fp8.py)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.files = [SafetensorsFile(f) for f in checkpoint_files(path)]
        self.file_of = {name: st for st in self.files for name in st.entries}
        fp8 = {n for n, st in self.file_of.items() if st.entries[n].dtype == torch.float8_e4m3fn}
        scales = [n for n in self.file_of if n.endswith(SCALE_SUFFIX)]
        if (fp8 or scales) and quantization_of(path) is None:
            raise FP8FormatError(
                f"{path}: {len(fp8)} float8_e4m3fn tensors (e.g. {sorted(fp8)[:1]}) but config.json has no "
                "quantization_config; add DeepSeek-V3's {'quant_method': 'fp8', 'weight_block_size': [128, 128], ...}"
            )
        orphans = [s for s in scales if s[: -len(SCALE_SUFFIX)] not in fp8]
        if orphans:
            raise FP8FormatError(f"{path}: scales {orphans[:5]} belong to no float8_e4m3fn weight")
        self.off_recipe = self.fp8_blocks = 0

    def close(self) -> None:
        for st in self.files:
            st.close()

    def read(self, name: str, rows: range | None = None) -> torch.Tensor:
        st = self.file_of[name]
        t = st.read(name) if rows is None else st.read_rows(name, rows.start, rows.stop)
        if t.dtype != torch.float8_e4m3fn:
            return t
        scale_name = name + SCALE_SUFFIX
        scale = self.file_of[scale_name].read(scale_name) if scale_name in self.file_of else None
        w = dequantize_entry(name, t, scale, str(self.path))  # checks the scale first
        assert scale is not None
        self.off_recipe += off_recipe_blocks(t, scale)
        self.fp8_blocks += scale.numel()
        return w


def stream_hf_state(model: Transformer, path: str | os.PathLike[str]) -> StreamReport:
    """Copy the weights of the HF directory `path` into `model` file by file, entry by entry, reading only the
    experts this rank holds (see the module docstring); FP8 block-quantized weights are dequantized (q * scale)
    into the masters, Mixtral's released names mapped onto ours. Names are checked both ways: a missing tensor
    of this rank, or an entry the model has no place for, is an error naming them."""
    path = Path(path)
    cfg = model.cfg
    _materialize_experts(model)
    dense = _dense_targets(model)
    owned = owned_experts(model)
    views = _expert_views(model)
    inter = cfg.moe_intermediate_size
    report = StreamReport()
    loaded: set[str] = set()
    unexpected: list[str] = []
    beyond: dict[int, int] = {}  # layer -> entries skipped
    ckpt = _Checkpoint(path)
    try:
        with torch.no_grad():
            for st in ckpt.files:
                for name, entry in st.entries.items():
                    if name.endswith(SCALE_SUFFIX):
                        continue  # read with its weight
                    layer = _LAYER.match(name)
                    if layer and int(layer.group(1)) >= cfg.num_layers:
                        # DeepSeek's multi-token-prediction layers (num_nextn_predict_layers) follow the decoder's;
                        # neither transformers nor we run them.
                        beyond[int(layer.group(1))] = beyond.get(int(layer.group(1)), 0) + 1
                        continue
                    if "rotary_emb" in name:
                        continue
                    ours = hf_mixtral.our_name(name) if cfg.arch == "mixtral" else name
                    if m := EXPERT_ENTRY.match(ours):
                        prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
                        if prefix not in owned or e >= cfg.n_routed_experts:
                            unexpected.append(name)
                            continue
                        if e not in owned[prefix]:
                            report.skipped.append(name)
                            continue
                        gate_up, down = views[prefix]
                        local = e - owned[prefix].start
                        if proj == "down_proj":
                            view = down[local]
                        else:
                            view = gate_up[local, :inter] if proj == "gate_proj" else gate_up[local, inter:]
                        _copy(view, ckpt.read(name), name)
                        loaded.add(ours)
                    elif (m := STACKED_ENTRY.match(ours)) and m.group(1) in owned:
                        # transformers' own stacked layout: this rank's rows only
                        prefix, kind = m.group(1), m.group(2)
                        mine = owned[prefix]
                        dst = views[prefix][0 if kind == "gate_up_proj" else 1]
                        if entry.shape[0] != cfg.n_routed_experts:
                            raise HFFormatError(
                                f"tensor {name}: {entry.shape[0]} experts in the checkpoint, "
                                f"n_routed_experts = {cfg.n_routed_experts} in the model"
                            )
                        _copy(dst, ckpt.read(name, mine), name)
                        projs = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
                        loaded |= {f"{prefix}.{e}.{p}.weight" for e in mine for p in projs}
                    elif ours in dense:
                        _copy(dense[ours], ckpt.read(name), name)
                        loaded.add(ours)
                    else:
                        unexpected.append(name)
                        continue
                    report.read.append(name)
                    report.bytes_read += entry.nbytes
    finally:
        ckpt.close()
    expected = set(dense) | set(_expected_expert_entries(owned))
    missing = sorted(expected - loaded)
    if cfg.arch == "mixtral":
        missing = [hf_mixtral.released_name(name) for name in missing]
    if missing or unexpected:
        raise HFFormatError(
            f"{path}: {len(missing)} missing tensors {missing[:5]} and {len(unexpected)} unexpected {unexpected[:5]}; "
            "is this checkpoint of the same architecture and shape as config.json says?"
        )
    refresh_expert_weight_copies(model)  # the masters were written in place, not through load_state_dict
    for moe in model.moe_layers():
        moe.tokens_per_expert.zero_()
    if beyond:
        log.info(
            "%s: skipped %d tensors of layers %s beyond the decoder's %d (multi-token-prediction layers, "
            "num_nextn_predict_layers; not trained or exported)",
            path,
            sum(beyond.values()),
            sorted(beyond),
            cfg.num_layers,
        )
    if ckpt.off_recipe:
        log.info(
            "%s: %d of %d FP8 blocks do not have the recipe's scale (amax / 448 with the block maximum at 448); "
            "an FP8 export rewrites their scales and e4m3 values",
            path,
            ckpt.off_recipe,
            ckpt.fp8_blocks,
        )
    log.info(
        "read %d entries (%.1f MB) of %s; %d expert entries of other ranks left unread",
        len(report.read),
        report.bytes_read / 1e6,
        path,
        len(report.skipped),
    )
    return report
