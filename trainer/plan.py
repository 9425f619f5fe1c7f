"""The memory planner (`slipstream plan`): the bytes one training rank holds, derived from the config.

Nothing here needs a GPU. Parameters, gradients and optimizer state come from the model the trainer's own
builder makes on the meta device (every tensor counted, so a new architecture knob is counted too):
fp32 masters (bf16 autocast casts them per use, it keeps no bf16 copy of the weights), fp32 gradients,
AdamW's two fp32 moments (Muon's one fp32 momentum for the matrices `trainer.optim.muon` gives it). Routed
experts are divided over the `ep` ranks; the rest over the `dp_shard` ranks (FSDP2, trainer/fsdp.py: dim 0 of
each dense tensor split into dp_shard equal blocks).

Activations are measured, not fitted: one dense and one MoE block (the config's widths, a few routed experts)
run forward on the CPU under bf16 autocast at a small token count, per activation-checkpoint mode, and the
bytes their forward leaves allocated (the profiler's net of allocations and frees: what autograd keeps, plus the
block output) are scaled linearly with tokens; the router's [tokens, experts] tensors are scaled to the real
expert count from two expert counts. Attention is the exception: on the CPU SDPA keeps O(T) statistics like the
CUDA flash / efficient kernels do, so the O(T) measurement stands for them. The head (final norm, lm_head,
the loss's fp32 logits: trainer/core.py's cross_entropy_loss materialises logits.float() of the whole
micro-batch, not chunked) is measured the same way at the real vocabulary.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace

import torch

from common.config import Config, ModelConfig
from trainer.model.recompute import MODES, run_block
from trainer.model.transformer import Transformer, build_model
from trainer.optim import group_of, is_muon_matrix

GiB = 1024**3
H200_USABLE_GIB = 139.0
"""The default --gpu-memory: an H200 shows about 140 GiB to the driver (nvidia-smi: 143,771 MiB); the CUDA context,
cuBLAS and NCCL take about 1 GiB of it outside the caching allocator, so 139 GiB is what torch can allocate.
The workspace row covers the allocator's own rounding and fragmentation on top of the planned tensors."""
WORKSPACE_FRACTION = 0.05
"""Allocator allowance: the caching allocator's fragmentation (rounding to 2 MiB segments, blocks split and not
reused) plus cuBLAS / attention workspaces; 5% of the planned bytes, at least 1 GiB."""
PROBE_TOKENS = 64


class PlanError(ValueError):
    """A request the planner cannot answer; the message names the input and the fix."""


@dataclass
class Plan:
    """Bytes per rank by kind."""

    dense_params: int
    expert_params: int
    grads: int
    optimizer: int
    activations: int
    comm: int
    transient: int
    tokens: int
    mode: str

    @property
    def subtotal(self) -> int:
        return (
            self.dense_params
            + self.expert_params
            + self.grads
            + self.optimizer
            + self.activations
            + self.comm
            + self.transient
        )

    @property
    def workspace(self) -> int:
        return max(GiB, int(self.subtotal * WORKSPACE_FRACTION))

    @property
    def total(self) -> int:
        return self.subtotal + self.workspace

    def rows(self) -> list[tuple[str, int]]:
        return [
            ("params dense (fp32 masters, replicated)", self.dense_params),
            ("params routed experts (fp32, / ep)", self.expert_params),
            ("gradients (fp32)", self.grads),
            ("optimizer state (fp32 moments)", self.optimizer),
            (f"activations ({self.mode}, {self.tokens} tokens/micro-batch)", self.activations),
            ("RDEP dispatch+combine buffers (bf16)", self.comm),
            ("backward transient (logit grads / a recomputed block)", self.transient),
            ("workspace / allocator allowance", self.workspace),
            ("total", self.total),
        ]


def state_bytes(cfg: Config, ep: int = 1, dp_shard: int = 1) -> tuple[int, int, int, int]:
    """(dense param bytes, routed-expert param bytes, gradient bytes, optimizer bytes) per rank, from the model
    built on the meta device; dp_shard divides the dense part (FSDP2)."""
    mc = cfg.trainer.model
    if mc.n_routed_experts % ep:
        raise PlanError(
            f"trainer.parallel.ep = {ep} does not divide trainer.model.n_routed_experts = {mc.n_routed_experts}: "
            "use a divisor of the expert count"
        )
    with torch.device("meta"):
        model = Transformer(mc)
    dense = experts = opt = 0
    for name, p in model.named_parameters():
        routed = group_of(name) == "expert"
        n = p.numel() * p.element_size() // (ep if routed else dp_shard)
        moments = 1 if cfg.trainer.optim.muon and is_muon_matrix(name, p) else 2
        opt += moments * n
        if routed:
            experts += n
        else:
            dense += n
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return dense + buffers, experts, dense + experts, opt


def _net_forward_bytes(fn) -> int:  # type: ignore[no-untyped-def]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    out.float().sum().backward()
    return sum(e.self_cpu_memory_usage for e in prof.events())


def _probe_model(mc: ModelConfig, experts: int) -> Transformer:
    probe = replace(
        mc,
        num_layers=2,
        first_k_dense=1,
        n_routed_experts=experts,
        num_experts_per_tok=min(mc.num_experts_per_tok, experts),
        n_group=1,
        topk_group=1,
        vocab_size=8,
        max_seq_len=max(PROBE_TOKENS, 8),
    )
    return build_model(probe, seed=0)


def block_bytes(
    mc: ModelConfig, mode: str, tokens: int, dtype: torch.dtype = torch.bfloat16, seq: int = PROBE_TOKENS
) -> tuple[float, float]:
    """(dense block, MoE block) bytes the forward of `tokens` tokens keeps under `mode`, measured on the CPU.

    The probe runs each block at two token counts and two routed-expert counts; the bytes are linear in both
    (a + b*E + c*T + d*E*T: the constant is what the forward keeps per weight, e.g. autocast's bf16 copies of
    the weights saved for the backward; T*E the router's score tensors), so four forwards give the real shape's."""
    if mode not in MODES:
        raise PlanError(f"trainer.activation_checkpoint = {mode!r}: use one of {', '.join(MODES)}")
    k = mc.num_experts_per_tok
    e0, e1 = 2 * k, 4 * k
    # rows of min(seq, PROBE_TOKENS) tokens, one and two of them: the CPU's SDPA keeps O(tokens) per row like
    # the CUDA flash / efficient kernels, so the bytes are linear in the micro-batch's tokens
    s0 = min(seq, PROBE_TOKENS)
    t0, t1 = s0, 2 * s0
    key = (repr(mc), mode, str(dtype), str(s0))
    if key not in _MEASURED:
        _MEASURED[key] = _measure(mc, mode, dtype, (e0, e1), s0)
    f = _MEASURED[key]

    def at(i: int, e_real: int) -> float:
        # bilinear in (E, T) through the four measured corners
        ue = (e_real - e0) / (e1 - e0)
        ut = (tokens - t0) / (t1 - t0)
        return (
            f[(e0, t0)][i] * (1 - ue) * (1 - ut)
            + f[(e1, t0)][i] * ue * (1 - ut)
            + f[(e0, t1)][i] * (1 - ue) * ut
            + f[(e1, t1)][i] * ue * ut
        )

    return max(0.0, at(0, e0)), max(0.0, at(1, mc.n_routed_experts))


def _measure(
    mc: ModelConfig, mode: str, dtype: torch.dtype, es: tuple[int, int], s0: int
) -> dict[tuple[int, int], list[float]]:
    """The probe's bytes per (experts, tokens) corner: [dense block, MoE block], tokens in rows of s0."""
    f: dict[tuple[int, int], list[float]] = {}
    for e in es:
        model = _probe_model(mc, e)
        angles = model.rope_angles[:PROBE_TOKENS].unsqueeze(0)
        cos = (angles.cos() * model.rope_scale)[:, :s0]
        sin = (angles.sin() * model.rope_scale)[:, :s0]
        for b in (1, 2):
            t = b * s0
            figures = []
            for layer in model.model.layers:
                x = torch.randn(b, s0, mc.hidden_size, requires_grad=True)

                def fwd(layer=layer, x=x, cos=cos, sin=sin):  # type: ignore[no-untyped-def]
                    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                        return run_block(layer, mode, x, cos, sin)

                figures.append(float(_net_forward_bytes(fwd)))
            f[(e, t)] = figures
        del model  # before the next probe is built: a DeepSeek-V3-wide probe is gigabytes
    return f


_MEASURED: dict[tuple[str, str, str, str], dict[tuple[int, int], list[float]]] = {}


def head_bytes(mc: ModelConfig, tokens: int, dtype: torch.dtype = torch.bfloat16) -> float:
    """Final norm, lm_head and the loss (cross-entropy over logits.float(), as trainer/core.py computes it):
    bytes per token the forward keeps, measured at the real vocabulary and width."""
    norm = torch.nn.RMSNorm(mc.hidden_size)
    head = torch.nn.Linear(mc.hidden_size, mc.vocab_size, bias=False)
    with torch.no_grad():
        head.weight.normal_(0, 0.02)
    measured = []
    for t in (8, 16):
        x = torch.randn(t, mc.hidden_size, requires_grad=True)
        targets = torch.randint(0, mc.vocab_size, (t,))

        def fwd(x=x, targets=targets) -> torch.Tensor:  # type: ignore[no-untyped-def]
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                logits = head(norm(x))
            return torch.nn.functional.cross_entropy(logits.float(), targets, reduction="sum")

        measured.append(float(_net_forward_bytes(fwd)))
    per_token = (measured[1] - measured[0]) / 8
    return measured[0] + per_token * (tokens - 8)


def plan(
    cfg: Config,
    gpus: int,
    ep: int | None = None,
    mode: str | None = None,
    rows: int | None = None,
    dp_shard: int | None = None,
    seq: int | None = None,
) -> Plan:
    """The bytes one of `gpus` ranks holds for `cfg` (ep, dp_shard, AC mode, rows per micro-batch per rank: the
    config's unless given)."""
    tc = cfg.trainer
    if gpus < 1:
        raise PlanError(f"--gpus {gpus}: give the number of GPUs, at least 1")
    ep = tc.parallel.ep if ep is None else ep
    if ep < 1 or gpus % ep:
        raise PlanError(f"trainer.parallel.ep = {ep} does not divide --gpus {gpus}: use an ep that divides it")
    dp_shard = tc.parallel.dp_shard if dp_shard is None else dp_shard
    if dp_shard < 1 or gpus % (ep * dp_shard):
        raise PlanError(
            f"trainer.parallel.ep = {ep} times dp_shard = {dp_shard} does not divide --gpus {gpus}: the ranks are "
            "dp_replicate x dp_shard x ep"
        )
    mode = tc.activation_checkpoint if mode is None else mode
    mc = tc.model
    if seq is None:
        seq = tc.data.seq_len if tc.mode == "pretrain" else mc.max_seq_len
    if rows is None:
        rows = max(1, tc.data.batch_size // gpus)
    tokens = rows * seq
    dtype = torch.bfloat16 if tc.dtype == "bfloat16" else torch.float32
    dense_p, expert_p, grads, opt = state_bytes(cfg, ep, dp_shard)
    dense_b, moe_b = block_bytes(mc, mode, tokens, dtype, seq)
    n_dense = min(mc.first_k_dense, mc.num_layers) if mc.n_routed_experts else mc.num_layers
    # + the embedding's output (fp32: autocast leaves embeddings alone), the first block's input, and the token ids
    # its backward keeps
    embed = tokens * (mc.hidden_size * 4 + 8)
    act = int(n_dense * dense_b + (mc.num_layers - n_dense) * moe_b + head_bytes(mc, tokens, dtype) + embed)
    width = 2 if dtype == torch.bfloat16 else 4
    comm = 0 if ep == 1 else 2 * tokens * mc.num_experts_per_tok * mc.hidden_size * width
    # The backward's high-water mark above the kept activations: the loss's gradient of the logits (fp32, then
    # the bf16 gradient lm_head's backward takes: T x V x (4 + 2) bytes), or, under checkpointing, one MoE
    # block's forward run again with everything it keeps, whichever is larger (they are not live together).
    transient = tokens * mc.vocab_size * (4 + width)
    if mode != "none":
        transient = max(transient, int(block_bytes(mc, "none", tokens, dtype, seq)[1]))
    return Plan(dense_p, expert_p, grads, opt, act, comm, transient, tokens, mode)


def render(p: Plan, gpu_gib: float, gpus: int, ep: int, dp_shard: int) -> str:
    """The table and the one-line verdict."""
    lines = [f"per rank of {gpus} GPUs, ep = {ep}, dp_shard = {dp_shard}"]
    for name, b in p.rows():
        lines.append(f"  {name:<58} {b / GiB:10.2f} GiB")
    fits = p.total <= gpu_gib * GiB
    lines.append(f"verdict: {'fits' if fits else 'does NOT fit'} in {gpu_gib:g} GiB ({p.total / GiB:.1f} GiB planned)")
    return "\n".join(lines)


def cli_main(argv: list[str]) -> int:
    """`slipstream plan CONFIG --gpus N [--gpu-memory GiB] [--set KEY=VALUE ...]`."""
    import argparse

    from common.config import ConfigError, load_config
    from common.config.load import add_set_argument

    p = argparse.ArgumentParser(prog="slipstream plan", description="the memory one training rank needs")
    p.add_argument("config", help="TOML config file, e.g. configs/moonlet.toml")
    p.add_argument("--gpus", type=int, required=True, help="GPUs the trainer runs on")
    p.add_argument(
        "--gpu-memory",
        type=float,
        default=H200_USABLE_GIB,
        help=f"GiB one GPU's allocator can hand out (default {H200_USABLE_GIB:g}: an H200)",
    )
    add_set_argument(p)
    args = p.parse_args(argv)
    try:
        if args.gpu_memory <= 0:
            raise PlanError(f"--gpu-memory {args.gpu_memory:g}: give the usable GiB of one GPU, e.g. 139 for an H200")
        cfg = load_config(args.config, args.overrides)
        tc = cfg.trainer
        result = plan(cfg, args.gpus)
        print(render(result, args.gpu_memory, args.gpus, tc.parallel.ep, tc.parallel.dp_shard))
        if result.total > args.gpu_memory * GiB:
            print(suggest(cfg, args.gpus, args.gpu_memory))
    except (PlanError, ConfigError, FileNotFoundError) as exc:
        print(f"slipstream plan: {exc}", file=sys.stderr)
        return 2
    return 0


def suggest(cfg: Config, gpus: int, gpu_gib: float) -> str:
    """The first choice that fits, trying (cheapest first) larger ep, then AC modes, then fewer rows per
    micro-batch, then dp_shard (FSDP2 of the dense weights; ep x dp_shard must divide the GPUs)."""
    tc = cfg.trainer
    eps = [e for e in range(tc.parallel.ep, gpus + 1) if gpus % e == 0 and tc.model.n_routed_experts % e == 0]
    rows0 = max(1, tc.data.batch_size // gpus)
    for dp_shard in [d for d in (1, 2, 4, 8, 16, 32, 64, 128, 256) if gpus % d == 0]:
        for ep in [e for e in eps if gpus % (e * dp_shard) == 0]:
            for mode in ("none", "selective", "full"):
                rows = rows0
                while rows >= 1:
                    p = plan(cfg, gpus, ep=ep, mode=mode, rows=rows, dp_shard=dp_shard)
                    if p.total <= gpu_gib * GiB:
                        return (
                            f"fits with: trainer.parallel.ep={ep} trainer.parallel.dp_shard={dp_shard} "
                            f"trainer.activation_checkpoint={mode} rows/micro-batch/rank={rows}: "
                            f"{p.total / GiB:.1f} GiB"
                        )
                    rows //= 2
    return "no choice of ep, AC mode, rows and dp_shard fits: more GPUs or a larger --gpu-memory"
