"""FP8 block-quantized HF checkpoints in DeepSeek-V3's released layout: every Linear weight of the decoder
layers (attention projections, dense, shared and routed expert MLPs) stored in float8_e4m3fn beside a
`<name>_scale_inv` fp32 tensor of one scale per 128 x 128 block ([ceil(out/128), ceil(in/128)], partial
blocks at the ends), and config.json's `quantization_config` saying so. Embeddings, lm_head, norms, the
router gate and its correction bias stay in the checkpoint's float dtype. Import dequantizes (w = q * scale)
into our fp32/bf16 masters; export quantizes with the released recipe (scale = amax / 448, q = e4m3(w /
scale)).

Round trip: the recipe divides in IEEE fp32 (a true division, never a multiply by 1/448), and then
fl(fl(448 * s) / 448) == s for every s = fl(amax / 448) (checked over all 2^23 mantissas): an fp32 master
w = q * s whose block maximum has |q| = 448 gives back the same scale, and w / s rounds back to the same q.
So import -> export reproduces the bytes of a checkpoint made by this recipe when the masters are fp32.
Scales made another way (by a multiply with fl(1/448): 10.7% of them come back 1 ulp off) or bf16 masters
(every scale moves; the e4m3 values stay) do not; import logs how many blocks an export would rewrite."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

BLOCK = 128
E4M3_MAX = 448.0
SCALE_SUFFIX = "_scale_inv"
QUANTIZATION_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [BLOCK, BLOCK],
}
# The Linear weights the released layout stores in e4m3, as transformers' FineGrainedFP8 and vLLM's fp8 loader
# decide: every 2-D weight of a decoder layer (attention projections, dense, shared and routed experts) except
# the router gate, which stays in full precision (as do embeddings, lm_head, norms and the correction bias).
_LAYER_WEIGHT = re.compile(r"^model\.layers\.\d+\..+\.weight$")


class FP8FormatError(ValueError):
    """An FP8 checkpoint or its quantization_config is not the released block layout; the message names it."""


def is_quantized(name: str, ndim: int) -> bool:
    """Whether the released layout stores HF tensor `name` (of `ndim` dimensions) in e4m3 with block scales."""
    return ndim == 2 and bool(_LAYER_WEIGHT.match(name)) and not name.endswith(".gate.weight")


def quantization_config(arch: str, moe_layers: list[int]) -> dict:
    """config.json's quantization_config for an FP8 export. vLLM builds DeepSeek-V3's router unquantized but
    hands Qwen3-MoE's router the checkpoint's quantization unless `modules_to_not_convert` names it, as Qwen's
    FP8 releases do; so other families list their routers (and lm_head) there."""
    quant: dict = dict(QUANTIZATION_CONFIG)
    if arch != "deepseek_v3":
        moe = "block_sparse_moe" if arch == "mixtral" else "mlp"  # Mixtral's released module name
        quant["modules_to_not_convert"] = ["lm_head"] + [f"model.layers.{layer}.{moe}.gate" for layer in moe_layers]
    return quant


def check_quantization_config(quant: dict) -> None:
    """Refuse a quantization_config other than e4m3 with dynamic activations and 128 x 128 weight blocks."""
    for key, want in QUANTIZATION_CONFIG.items():
        got = quant.get(key, want if key == "fmt" else None)
        if (list(got) if isinstance(got, (list, tuple)) else got) != want:
            raise FP8FormatError(
                f"config.json quantization_config.{key} = {got!r}; only {want!r} is supported "
                "(DeepSeek-V3's FP8 block layout)"
            )


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def scale_shape(shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """The weight_scale_inv shape of a [out, in] weight: one scale per 128 x 128 block."""
    out, inp = shape
    return _blocks(out), _blocks(inp)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """q [out, in] e4m3 and scale [ceil(out/128), ceil(in/128)] -> fp32 w = q * scale of q's block."""
    out, inp = q.shape
    full = scale.float().repeat_interleave(BLOCK, dim=0).repeat_interleave(BLOCK, dim=1)
    return q.float() * full[:out, :inp]


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (q e4m3, scale fp32 [ceil(out/128), ceil(in/128)]) by the released recipe: scale =
    amax / 448 per block (an all-zero block gets 1.0, transformers' convention), q = e4m3(w / scale), the
    nearest e4m3 value."""
    out, inp = w.shape
    nb, kb = scale_shape(w.shape)
    blocks = F.pad(w.float(), (0, kb * BLOCK - inp, 0, nb * BLOCK - out)).view(nb, BLOCK, kb, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))
    # A tensor divisor: CUDA torch turns a division by a Python scalar into a multiply by its reciprocal,
    # which is not the recipe's division and breaks the round trip (module docstring).
    scale = torch.where(amax > 0, amax / torch.full_like(amax, E4M3_MAX), torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).view(nb * BLOCK, kb * BLOCK)[:out, :inp]
    return q.to(torch.float8_e4m3fn).contiguous(), scale


def quantize_tensors(
    tensors: Iterator[tuple[str, torch.Tensor]], cast: Callable[[str, torch.Tensor], torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The released layout of (HF name, tensor) pairs: each quantized weight becomes (name, q) and
    (name + "_scale_inv", scale); the others become (name, cast(name, tensor))."""
    for name, t in tensors:
        if not is_quantized(name, t.dim()):
            yield name, cast(name, t)
            continue
        if not torch.isfinite(t).all():
            raise FP8FormatError(f"tensor {name} has non-finite values; it cannot be block-quantized")
        q, scale = quantize(t)
        yield name, q
        yield name + SCALE_SUFFIX, scale


def dequantize_entry(name: str, q: torch.Tensor, scale: torch.Tensor | None, where: str) -> torch.Tensor:
    """One e4m3 checkpoint entry `name` and its weight_scale_inv -> fp32 weights; refuses a missing scale, one of
    the wrong shape, and one that is not finite non-negative fp32, naming the tensor."""
    if scale is None:
        raise FP8FormatError(f"{where}: e4m3 tensor {name} has no {name + SCALE_SUFFIX}")
    if q.dim() != 2 or tuple(scale.shape) != scale_shape(q.shape[-2:]):
        raise FP8FormatError(
            f"{where}: {name + SCALE_SUFFIX} has shape {tuple(scale.shape)}; a weight of shape "
            f"{tuple(q.shape)} needs {scale_shape(q.shape[-2:])} (128 x 128 blocks)"
        )
    if scale.dtype != torch.float32 or not (torch.isfinite(scale).all() and (scale >= 0).all()):
        raise FP8FormatError(f"{where}: {name + SCALE_SUFFIX} must be finite non-negative float32 scales")
    return dequantize(q, scale)


def off_recipe_blocks(q: torch.Tensor, scale: torch.Tensor) -> int:
    """How many blocks of an e4m3 weight an FP8 export of its fp32 dequantization would not write back as they
    are: blocks whose largest |q| is not 448 or whose scale is not a fixed point of s -> fl(fl(448 s) / 448)
    (an all-zero block: whose scale is not 1.0). Zero for a checkpoint made by the released recipe."""
    out, inp = q.shape
    nb, kb = scale_shape(q.shape)
    qmax = F.pad(q.float().abs(), (0, kb * BLOCK - inp, 0, nb * BLOCK - out)).view(nb, BLOCK, kb, BLOCK).amax((1, 3))
    e4m3_max = torch.full_like(scale, E4M3_MAX)
    fixed = (scale > 0) & (scale * e4m3_max / e4m3_max == scale)
    kept = torch.where(qmax == 0, scale == 1.0, (qmax == E4M3_MAX) & fixed)
    return int((~kept).sum())
