"""The optimizer step: AdamW over three parameter groups with their own peak learning rates (dense,
router gate, routed experts), the WSD schedule in tokens, global gradient-norm clipping, and the
aux-loss-free router-bias update with its own rate. Parameters are the fp32 master weights and
AdamW's moments are fp32; `autocast` gives bf16 compute on top of them (weights are cast per op in
the forward, gradients land in fp32). Under data and expert parallelism the step first reduces the
gradients and expert loads through the model's `ParallelPlan` (trainer/ep) and clips by the global
norm. After writing the masters it refreshes the bf16 expert-weight copies itself. Gradient
accumulation is the training core's loop of backward passes before one `Optimizer.step`. With
`trainer.optim.muon` the blocks' 2-D dense matrices are stepped by torch's Muon instead (nmoe's choice);
both optimizers share the schedule, the clipping and the checkpoint."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from common.config import OptimConfig
from trainer.ep.parallel import ParallelPlan
from trainer.model.moe import MoE, refresh_expert_weight_copies
from trainer.schedule import WSD

GROUPS = ("dense", "router", "expert")


def group_of(name: str) -> str:
    """Which learning-rate group a parameter (by its HF-style name) belongs to."""
    if ".mlp.experts." in name:
        return "expert"
    if name.endswith(".mlp.gate.weight"):
        return "router"
    return "dense"


def is_muon_matrix(name: str, p: torch.Tensor) -> bool:
    """Muon's parameters: 2-D dense matrices inside the blocks (attention and dense-MLP projections, shared
    experts). Embeddings and the output head (lookup-like), norms, the router gate and the stacked routed
    experts stay on AdamW."""
    return p.ndim == 2 and group_of(name) == "dense" and name.startswith("model.layers.")


@dataclass
class RouterStats:
    """Balance telemetry of one MoE layer over the tokens of the last optimizer step."""

    layer: int
    load_cv: float
    """Coefficient of variation (std / mean) of tokens per expert; 0 = perfectly balanced."""
    load_entropy: float
    """Entropy of the token share per expert, over log(E): 1 = perfectly balanced."""
    bias_min: float
    bias_max: float


@dataclass
class StepStats:
    step: int
    tokens: int
    lr_factor: float
    grad_norm: float
    bias_rate: float
    router: list[RouterStats] = field(default_factory=list)


def router_figures(stats: list[RouterStats]) -> dict[str, float]:
    """The per-layer router telemetry as metric tags: router/layer<i>/load_cv, entropy, bias_range."""
    out: dict[str, float] = {}
    for r in stats:
        out[f"router/layer{r.layer}/load_cv"] = r.load_cv
        out[f"router/layer{r.layer}/entropy"] = r.load_entropy
        out[f"router/layer{r.layer}/bias_range"] = r.bias_max - r.bias_min
    return out


def router_stats(model: nn.Module) -> list[RouterStats]:
    """Telemetry of every MoE layer from the token counts accumulated since the last bias update."""
    out = []
    for name, mod in model.named_modules():
        if not isinstance(mod, MoE):
            continue
        load = mod.tokens_per_expert.double()
        total = float(load.sum())
        if total == 0:
            continue
        share = load / total
        ent = float(-(share * share.clamp_min(1e-30).log()).sum()) / float(torch.log(torch.tensor(load.numel())))
        bias = getattr(mod.gate, "e_score_correction_bias", torch.zeros(1))
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
        cv = float(load.std(unbiased=False) / load.mean())
        out.append(RouterStats(layer, cv, ent, float(bias.min()), float(bias.max())))
    return out


class Optimizer:
    """AdamW + WSD + clipping + router-bias balancing for one model. `step(tokens)` after the backward
    passes of one batch; `tokens` is the number of trained tokens in that batch (over all ranks).
    `plan` is the model's parallel plan (None: one rank)."""

    def __init__(self, model: nn.Module, cfg: OptimConfig, plan: ParallelPlan | None = None) -> None:
        self.model = model
        self.cfg = cfg
        self.plan = plan
        self.schedule = WSD.from_config(cfg)
        peak = {"dense": cfg.lr, "router": cfg.router_lr, "expert": cfg.expert_lr}
        buckets: dict[tuple[str, bool], list[nn.Parameter]] = {}
        matrices: list[nn.Parameter] = []
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            if cfg.muon and is_muon_matrix(name, p):
                matrices.append(p)
                continue
            # Norm gains (1-D) are not decayed: shrinking them towards 0 only fights the normalisation.
            buckets.setdefault((group_of(name), p.ndim >= 2), []).append(p)
        ordered = sorted(buckets.items())
        groups = [
            {
                "params": ps,
                "name": g,
                "peak_lr": peak[g],
                "lr": peak[g],
                "weight_decay": cfg.weight_decay if dec else 0.0,
            }
            for (g, dec), ps in ordered
        ]
        self.params = [p for _, ps in ordered for p in ps] + matrices
        fused = bool(self.params) and all(p.is_cuda for p in self.params)
        beta1, beta2 = cfg.betas  # two numbers (the config's validation)
        self.adamw = torch.optim.AdamW(
            groups, lr=cfg.lr, betas=(beta1, beta2), eps=cfg.eps, weight_decay=cfg.weight_decay, fused=fused or None
        )
        self.optimizers: list[torch.optim.Optimizer] = [self.adamw]
        if matrices:
            # Replicated matrices with all-reduced gradients: every rank orthogonalises the same momentum, so
            # W ranks take W = 1's step. The rate is rescaled to AdamW's update RMS, so `lr` means the same.
            muon_group = {
                "params": matrices,
                "name": "dense",
                "peak_lr": cfg.lr,
                "lr": cfg.lr,
                "weight_decay": cfg.weight_decay,
            }
            self.optimizers.append(
                torch.optim.Muon(
                    [muon_group],
                    lr=cfg.lr,
                    weight_decay=cfg.weight_decay,
                    momentum=cfg.muon_momentum,
                    adjust_lr_fn="match_rms_adamw",
                )
            )
        self.steps = 0
        self.tokens = 0

    def reset_moments(self) -> None:
        """Forget AdamW's moments and step counts (a new phase with another objective, e.g. RL after a
        supervised warm start: moments of the warm start's larger gradients would shrink the first RL steps)."""
        for opt in self.optimizers:
            opt.state.clear()

    def bias_rate(self, tokens: int) -> float:
        """The aux-loss-free bias step after `tokens` tokens (falls to 0 over the decay phase if configured)."""
        decay = self.schedule.decay_progress(tokens) if self.cfg.bias_update_decay else 0.0
        return self.cfg.bias_update_rate * (1.0 - decay)

    def clip_gradients(self, max_norm: float) -> float:
        """Clip to the global gradient norm (over every rank's shards) and return the norm before clipping."""
        if self.plan is not None:
            return self.plan.clip_gradients(max_norm)
        return float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))

    def step(self, tokens: int, lr: float | None = None) -> StepStats:
        """One AdamW step after the backward passes of `tokens` trained tokens (over all ranks). `lr`, when
        given, is a constant rate for every group instead of the schedule, and the router biases are left
        alone (the loads still accumulate): a supervised warm start. Measured on the demo, balancing during
        its 250 steps took it to 64% held-out instead of 15%, leaving RL little to show."""
        if self.plan is not None:
            self.plan.reduce_gradients()
            self.plan.reduce_expert_load()
        self.tokens += tokens
        factor = self.schedule.lr_factor(self.tokens)
        for grp in (g for opt in self.optimizers for g in opt.param_groups):
            grp["lr"] = grp["peak_lr"] * factor if lr is None else lr
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        grad_norm = self.clip_gradients(max_norm)
        for opt in self.optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        refresh_expert_weight_copies(self.model)
        telemetry = router_stats(self.model)
        rate = self.bias_rate(self.tokens)
        for mod in self.model.modules():
            if isinstance(mod, MoE) and lr is None:
                mod.update_bias(rate)
        self.steps += 1
        return StepStats(self.steps, self.tokens, factor, grad_norm, rate, telemetry)


@contextlib.contextmanager
def autocast(device: torch.device, dtype: str) -> Iterator[None]:
    """Compute in `dtype` ("bfloat16" or "float32") over fp32 master weights."""
    if dtype == "float32":
        yield
        return
    if dtype != "bfloat16":
        raise ValueError(f"trainer.dtype {dtype!r} is not float32 or bfloat16")
    with torch.autocast(device.type, dtype=torch.bfloat16):
        yield
