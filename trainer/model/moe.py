"""Feed-forward blocks: the dense SwiGLU MLP and the MoE layer (router, shared experts, routed
experts stored stacked for grouped GEMM).

Routing follows the two architectures we export to. DeepSeek-V3: sigmoid scores; experts are chosen
on score + `e_score_correction_bias` (optionally only inside the best `topk_group` of `n_group`
groups), weighted by the unbiased scores, normalised over the top-k, then multiplied by
`routed_scaling_factor`. The bias is not trained by gradients: `update_bias` nudges it by a fixed
step against each expert's load error (aux-loss-free balancing). Qwen3-MoE and Mixtral: softmax scores,
top-k, optional renormalisation (Mixtral: always), no bias. An optional DeepSeek sequence-wise balance loss is computed on
request. Tokens are permuted to expert order with one stable sort, run through the chosen expert
backend, and combined back with gathers whose backward is also a gather, so the result does not
depend on atomic-add order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.config import ModelConfig
from trainer.experts import BACKENDS
from trainer.experts.cutedsl.quant import quantize_expert_weights_fast
from trainer.model.permute import combine, permute, select_permute


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b of bf16 operands with fp32 accumulation and an fp32 result (tensor cores on GPUs)."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())  # the same products, exactly: bf16 x bf16 fits an fp32 mantissa


class _SplitLinear(torch.autograd.Function):
    """fp32-accurate x @ w.T for bf16 x and fp32 w on bf16 tensor cores.

    w is split into three bf16 parts whose sum is w exactly (8 + 8 + 8 mantissa bits); each product of
    bf16 numbers is exact in fp32, so one GEMM of x against the stacked parts, accumulated in fp32,
    gives the fp32 logits up to summation order, at a third of the cost of an fp32 GEMM (H200: fp32
    GEMMs run at ~50 TFLOP/s, bf16 at ~700). The backward splits the fp32 gradient in two parts the
    same way (relative error ~2^-16, far below the bf16 rounding of x's gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        w1 = w.to(torch.bfloat16)
        rest = w - w1.float()
        w2 = rest.to(torch.bfloat16)
        w3 = (rest - w2.float()).to(torch.bfloat16)
        parts = _mm_fp32(x, torch.cat([w1, w2, w3]).t()).view(x.shape[0], 3, -1)  # [T, 3, E]
        ctx.save_for_backward(x, w1, w2)
        return parts[:, 0] + (parts[:, 1] + parts[:, 2])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w1, w2 = ctx.saved_tensors
        g1 = grad.to(torch.bfloat16)
        g2 = (grad - g1.float()).to(torch.bfloat16)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:  # g1 w1 + g2 w1 + g1 w2: one GEMM over the concatenated inner dimension
            grad_x = _mm_fp32(torch.cat([g1, g2, g1], dim=1), torch.cat([w1, w1, w2])).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = _mm_fp32(torch.cat([g1, g2], dim=1).t(), x).view(2, *w1.shape).sum(0)
        return grad_x, grad_w


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 router logits x @ weight.T, whatever the dtype of x (bf16 under autocast)."""
    if x.dtype == torch.bfloat16 and weight.dtype == torch.float32:
        return _SplitLinear.apply(x, weight)
    return F.linear(x.float(), weight.float())


class Router(nn.Module):
    """Top-k expert choice. `weight` [E, H] is the gate; `e_score_correction_bias` exists for sigmoid scoring."""

    e_score_correction_bias: torch.Tensor  # a buffer, registered for sigmoid scoring only

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.sigmoid = cfg.arch == "deepseek_v3"
        self.top_k = cfg.num_experts_per_tok
        self.num_experts = cfg.n_routed_experts
        self.n_group = cfg.n_group
        self.topk_group = cfg.topk_group
        self.norm_topk_prob = cfg.norm_topk_prob
        self.scaling = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        if self.sigmoid:
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))

    def forward(
        self, x: torch.Tensor, replay: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] fp32, expert ids [T, k], scores [T, E] fp32). `replay` [T, k]: experts
        to use instead of the router's choice (rows of -1: the router's own choice), weighted by its scores."""
        scores = self.scores(x)
        ids = self.choose(scores)
        if replay is not None:
            ids = torch.where(replay[:, :1] >= 0, replay.long(), ids)
        return self.weigh(scores, ids), ids, scores

    def scores(self, x: torch.Tensor) -> torch.Tensor:
        """Per-expert scores [T, E] fp32: softmax (Qwen3-MoE, Mixtral) or sigmoid (DeepSeek-V3) of the router logits."""
        # Routing decisions are made in fp32 even under bf16 autocast: near-ties flip experts otherwise.
        with torch.autocast(x.device.type, enabled=False):
            logits = router_logits(x, self.weight)
        return logits.sigmoid() if self.sigmoid else logits.softmax(dim=-1)

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        """The router's own top-k expert ids [T, k] (DeepSeek-V3: on score + bias, within the best groups)."""
        if not self.sigmoid:
            return scores.topk(self.top_k, dim=-1).indices
        choice = (scores + self.e_score_correction_bias).detach()
        if self.n_group > 1:
            T = choice.shape[0]
            grouped = choice.view(T, self.n_group, -1)
            group_score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # [T, groups]
            keep = torch.zeros_like(group_score, dtype=torch.bool)
            keep.scatter_(1, group_score.topk(self.topk_group, dim=-1).indices, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(T, -1)
        return choice.topk(self.top_k, dim=-1).indices

    def weigh(self, scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Gate weights [T, k] of the experts `ids`: their (unbiased) scores, optionally normalised, scaled.
        Gradients reach the router through the scores, whoever chose the experts."""
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if self.sigmoid else 0.0))
        return weights * self.scaling


def _refresh_after_load(module: ExpertWeights, incompatible_keys: object) -> None:
    module.refresh_weight_copy()


def refresh_expert_weight_copies(model: nn.Module) -> None:
    """Refresh the weight copy of every expert module (`Experts`, and trainer.ep's `ShardedExperts`) in `model`:
    trainer.optim.Optimizer calls it after each step; call it after any other in-place write of the expert
    masters (`load_state_dict` refreshes by itself)."""
    for mod in model.modules():
        if isinstance(mod, ExpertWeights):
            mod.refresh_weight_copy()


class ExpertWeights(nn.Module):
    """What every routed-expert module shares: its masters (gate_up [E, 2I, H], down [E, H, I], given by
    `masters()`) run through the expert backend `backend`, on a per-step copy of the weights.

    Under bf16 autocast over fp32 masters the grouped GEMMs run on a bf16 copy of the weights instead of
    casting 600M fp32 weights per call (about a third of the expert GEMMs of a 16k-token batch); the FP8
    backend (`cutedsl_fp8`) on their FP8 block-quantized pack instead (trainer/experts/fp8.py). A forward
    that finds no copy casts per call and asks for one; the copy is then made, and after that rewritten in
    place, by every step of the training core's optimizer (trainer.optim.Optimizer), by `load_state_dict` and by
    `weight_copy` / `refresh_weight_copy`; `.to()` drops it. Other in-place writes to the masters must call
    `refresh_weight_copy`. The forward checks no freshness, so a compiled block has no graph break and
    guards only on the copy existing (one recompile when it appears). The copy is a plain attribute, never
    a buffer, so state dicts and checkpoints hold the fp32 masters only."""

    gate_up_proj: nn.Parameter  # [E, 2I, H] over all E experts (a subclass may hold this rank's block as a DTensor)
    down_proj: nn.Parameter  # [E, H, I]

    def __init__(self, backend: str) -> None:
        super().__init__()
        self.backend = backend
        self._cast: tuple[torch.Tensor, ...] | None = None
        self._copy_dtype: torch.dtype | None = None  # the token dtype a forward asked a copy for
        self.register_load_state_dict_post_hook(_refresh_after_load)

    def masters(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up, down) as the GEMMs take them (this rank's plain tensors)."""
        raise NotImplementedError

    @torch.no_grad()
    def refresh_weight_copy(self) -> None:
        """Make the copy a forward asked for, or rewrite the existing one from the masters in place (so that
        a backward still holding the old copy fails autograd's version check)."""
        params = self.masters()
        if self.backend == "cutedsl_fp8":
            if self._copy_dtype is None:
                return
            # From the masters (one rounding, not two), into the existing pack when there is one; on a GPU in one
            # pass over each weight (the CuTeDSL kernel), elsewhere by the torch function (the same bits).
            self._cast = quantize_expert_weights_fast(*params, out=self._cast)
        elif self._cast is not None:
            for c, p in zip(self._cast, params, strict=True):
                c.copy_(p)
        elif self._copy_dtype is not None:
            self._cast = tuple(p.detach().to(self._copy_dtype, copy=True) for p in params)

    def weight_copy(self, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """The copy the GEMMs read for tokens in `dtype`, without autograd history, made now if missing (eager
        callers: tests, benches that take no optimizer step): (gate_up, down) in `dtype`, or for `cutedsl_fp8`
        the 8 tensors of `quantize_expert_weights`."""
        if self._cast is None or self._copy_dtype != dtype:
            self._cast, self._copy_dtype = None, dtype
            self.refresh_weight_copy()
        assert self._cast is not None  # refresh_weight_copy makes it once a dtype is asked for
        return self._cast

    def _apply(self, fn, recurse=True):  # .to(), .cuda(), .half(): the copy would be on the old device/dtype
        self._cast = None
        return super()._apply(fn, recurse)

    def __getstate__(self) -> dict:  # deepcopy / pickle: the copy is remade at the first refresh
        return {**super().__getstate__(), "_cast": None}

    def run_backend(self, x_sorted: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The backend over rows sorted by expert (offsets: running ends), on the copy when there is one."""
        gate_up, down = self.masters()
        if self.backend in ("grouped_mm", "cutedsl", "cutedsl_fp8") and (
            gate_up.dtype != x_sorted.dtype or self.backend == "cutedsl_fp8"
        ):
            cast = self._cast
            if cast is None or self._copy_dtype != x_sorted.dtype:
                self._copy_dtype, cast = x_sorted.dtype, None  # the backend casts (or quantizes) per call
            return BACKENDS[self.backend](x_sorted, offsets, gate_up, down, cast)
        return BACKENDS[self.backend](x_sorted, offsets, gate_up, down)


class Experts(ExpertWeights):
    """Routed experts, stacked: gate_up_proj [E, 2I, H] (gate rows then up rows), down_proj [E, H, I], run on a
    per-step weight copy (ExpertWeights)."""

    def __init__(self, cfg: ModelConfig, backend: str) -> None:
        super().__init__(backend)
        E, H, inter = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * inter, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, inter))

    def masters(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_up_proj, self.down_proj

    def forward(self, x_sorted: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        # Autocast does not cover grouped GEMMs: run them in its dtype ourselves, else the fp32 residual
        # stream would make every expert GEMM fp32.
        dev = x_sorted.device.type
        if torch.is_autocast_enabled(dev):
            x_sorted = x_sorted.to(torch.get_autocast_dtype(dev))
        return self.run_backend(x_sorted, offsets)


class MoE(nn.Module):
    """Shared experts + routed experts; records per-expert token counts while training."""

    tokens_per_expert: torch.Tensor  # a buffer

    def __init__(self, cfg: ModelConfig, backend: str, permute: str = "auto") -> None:
        super().__init__()
        self.permute = permute
        """`auto | torch | triton`: how tokens are permuted to expert order and combined (trainer/model/permute.py)."""
        self.top_k = cfg.num_experts_per_tok
        self.num_experts = cfg.n_routed_experts
        self.gate = Router(cfg)
        self.experts: ExpertWeights = Experts(cfg, backend)  # trainer.ep swaps in its ShardedExperts
        self.shared_experts = (
            MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts) if cfg.n_shared_experts else None
        )
        # Tokens routed to each expert since the last `update_bias` (training forwards only).
        self.register_buffer("tokens_per_expert", torch.zeros(cfg.n_routed_experts), persistent=False)
        self.compute_aux_loss = False
        self.recomputing = False
        """True while activation checkpointing runs this layer's forward again in the backward
        (trainer/model/recompute.py): the load was counted by the first forward."""
        self.aux_loss: torch.Tensor | None = None
        self.routing_disagreement: tuple[torch.Tensor, torch.Tensor] | None = None
        """(rows' tokens whose router top-k differs from the given routing, rows' tokens with given routing),
        each [B], of the last forward that was given a routing."""

    def forward(self, x: torch.Tensor, routing: torch.Tensor | None = None, replay: bool = False) -> torch.Tensor:
        """x [B, S, H]. `routing` [B, S, k]: the experts the rollout (vLLM) chose per token, -1 where unknown.
        With it, `routing_disagreement` counts per row the tokens whose top-k set differs from the router's
        own; with `replay` the given experts are used (rollout routing replay) and, as their choice was not
        this router's, those tokens are left out of the load that the aux-free bias update balances."""
        B, S, H = x.shape
        flat = x.reshape(B * S, H)
        weights, ids, scores = self.gate(flat)  # the router's own choice (forward hooks on `gate` see it)
        given = None
        self.routing_disagreement = None
        if routing is not None:
            routing = routing.reshape(B * S, -1).long()
            given = routing[:, 0] >= 0
            with torch.no_grad():
                differs = (ids.sort(dim=-1).values != routing.sort(dim=-1).values).any(-1) & given
                self.routing_disagreement = (differs.view(B, S).sum(1), given.view(B, S).sum(1))
            if replay:
                ids = torch.where(given.unsqueeze(1), routing, ids)
                weights = self.gate.weigh(scores, ids)
        T, k = ids.shape
        slot_expert = ids.reshape(-1)  # slot = token * k + choice
        order = torch.argsort(slot_expert, stable=True)  # slots in expert order
        sorted_pos = torch.empty_like(order)
        sorted_pos[order] = torch.arange(order.numel(), device=order.device)
        # scatter_add rather than bincount: bincount's output size depends on the data (a host sync).
        counts = slot_expert.new_zeros(self.num_experts).scatter_add_(0, slot_expert, torch.ones_like(slot_expert))
        load = counts
        if replay and given is not None:
            own = (~given).repeat_interleave(k).to(slot_expert.dtype)
            load = slot_expert.new_zeros(self.num_experts).scatter_add_(0, slot_expert, own)
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        # Permute in the compute dtype: the k copies of every token are the largest tensor of the layer.
        rows = flat.to(torch.get_autocast_dtype(x.device.type)) if torch.is_autocast_enabled(x.device.type) else flat
        impl = select_permute(self.permute, x.device)
        x_sorted = permute(rows, sorted_pos, order, k, impl)
        y_sorted = self.experts(x_sorted, offsets)
        out = combine(y_sorted, weights, sorted_pos, order, impl)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        if self.training and not self.recomputing:
            with torch.no_grad():
                self.tokens_per_expert += load.to(self.tokens_per_expert.dtype)
        self.aux_loss = self._sequence_aux_loss(scores, ids, B, S) if self.compute_aux_loss else None
        return out.view(B, S, H)

    def _sequence_aux_loss(self, scores: torch.Tensor, ids: torch.Tensor, B: int, S: int) -> torch.Tensor:
        """DeepSeek-V3 sequence-wise balance loss: sum_i f_i * P_i per sequence, averaged over sequences."""
        E, k = self.num_experts, self.top_k
        probs = (scores / scores.sum(-1, keepdim=True)).view(B, S, E)
        chosen = torch.zeros(B, S * k, E, device=scores.device).scatter_(2, ids.view(B, S * k, 1), 1.0)
        f = chosen.sum(1) * (E / (k * S))  # [B, E]
        return (f * probs.mean(1)).sum(-1).mean()

    @torch.no_grad()
    def update_bias(self, rate: float) -> None:
        """Aux-loss-free balancing step: bias += rate * sign(mean load - load); resets the counts.

        Under data parallelism, all-reduce `tokens_per_expert` across ranks before calling this."""
        load = self.tokens_per_expert
        if hasattr(self.gate, "e_score_correction_bias") and rate > 0 and load.sum() > 0:
            self.gate.e_score_correction_bias += rate * torch.sign(load.mean() - load)
        load.zero_()
