"""The memory planner (`slipstream plan`): the bytes one training rank holds, derived from the config.

Nothing here needs a GPU. Parameters, gradients and optimizer state come from the model the trainer's own
builder makes on the meta device (every tensor counted, so a new architecture knob is counted too): fp32
masters, fp32 gradients, AdamW's two fp32 moments (Muon's one fp32 momentum for the matrices
`trainer.optim.muon` gives it), and under bf16 the routed experts' per-step weight copy the grouped GEMMs read
(bf16, or the FP8 pack: 2 bytes a weight either way; dense weights are cast per use by autocast). Routed experts
are divided over the `ep` ranks; the rest over the `dp_shard` ranks (FSDP2, trainer/fsdp.py: dim 0 of each dense
tensor split into dp_shard equal blocks).

Activations are measured, not fitted: one dense and one MoE block (the config's widths, a few routed experts,
the expert backend the trainer would run) run forward on the CPU under the run's autocast dtype, per
activation-checkpoint mode, and the bytes their forward leaves allocated (the profiler's net of allocations and
frees: what autograd keeps, plus the block output) are scaled linearly with tokens; the router's [tokens,
experts] tensors are scaled to the real expert count from two expert counts. Attention is the one kernel the
CPU runs differently: its SDPA math path keeps fp32 operands and the S x S probabilities, where CUDA's fused
kernels keep q, k, v, the output and fp32 statistics; the probe runs attention under `fused_kernel_saves`
(trainer/model/attention.py), which keeps what they keep. The head (final norm, lm_head, the loss's fp32
logits: trainer/core.py's cross_entropy_loss materialises logits.float() of the whole micro-batch, not chunked)
is measured the same way at the real vocabulary. `Plan` says how these make the step's high-water mark.
With `trainer.compile` the probe's blocks are compiled too (inductor on the CPU): they keep less than eager ones.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace

import torch

from common.config import Config, ModelConfig
from trainer.model.attention import fused_kernel_saves
from trainer.model.recompute import MODES, run_block
from trainer.model.transformer import Transformer, build_model, compile_blocks
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
    """Bytes per rank by kind, and the high-water mark they make.

    The weights, their copy and the optimizer state live through the whole step. The gradients do not: the
    optimizer sets them to None after each step, so with one micro-batch per update they appear during the
    backward as the activations are freed, layer by layer from the last. The peak is then the larger of the
    backward's start (every kept activation, plus the logits' gradient or the last block run again) and its end
    (every gradient, plus the first block run again under checkpointing). When micro-batches accumulate, the
    first one's gradients are live through every later forward and backward, and count at the start too."""

    dense_params: int
    expert_params: int
    weight_copy: int
    grads: int
    optimizer: int
    activations: int
    comm: int
    transient: int
    recompute: int
    tokens: int
    mode: str
    accumulating: bool

    @property
    def subtotal(self) -> int:
        static = self.dense_params + self.expert_params + self.weight_copy + self.optimizer + self.comm
        if self.accumulating:
            return static + self.grads + max(self.activations + self.transient, self.recompute)
        return static + max(self.activations + self.transient, self.grads + self.recompute)

    @property
    def grads_at_peak(self) -> bool:
        """Whether the gradients are live at the high-water mark."""
        return self.accumulating or self.grads + self.recompute > self.activations + self.transient

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
            ("routed experts' per-step weight copy (bf16 / FP8 pack)", self.weight_copy),
            ("optimizer state (fp32 moments)", self.optimizer),
            ("RDEP dispatch+combine buffers (bf16)", self.comm),
            (f"gradients (fp32; {'live' if self.grads_at_peak else 'not yet made'} at the peak)", self.grads),
            (f"activations ({self.mode}, {self.tokens} tokens/micro-batch)", self.activations),
            ("backward transient (logit grads / last block again)", self.transient),
            ("a block run again (checkpointing's recomputation)", self.recompute),
            ("workspace / allocator allowance", self.workspace),
            ("peak (the backward's start or end: docs/ARCHITECTURE.md)", self.total),
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
    """The bytes `fn`'s forward allocates and does not free: what its graph keeps for the backward. The backward
    itself is not run: dropping the output frees the graph (on two cores a DeepSeek-V3-wide block's bf16 backward
    took most of an hour, for figures the forward alone gives)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    del out
    return sum(e.self_cpu_memory_usage for e in prof.events())


def probe_model(
    mc: ModelConfig, experts: int, backend: str, seq: int = PROBE_TOKENS, device: str | torch.device = "cpu"
) -> Transformer:
    """The probe: the config's widths, one dense and one MoE block of `experts` routed experts, vocabulary 8, rows of
    up to `seq` tokens (bench/act_census.py builds the same one on a GPU)."""
    probe = replace(
        mc,
        num_layers=2,
        first_k_dense=1,
        n_routed_experts=experts,
        num_experts_per_tok=min(mc.num_experts_per_tok, experts),
        n_group=1,
        topk_group=1,
        vocab_size=8,
        max_seq_len=max(seq, 8),
    )
    return build_model(probe, backend, seed=0, device=device)


def block_bytes(
    mc: ModelConfig,
    mode: str,
    tokens: int,
    dtype: torch.dtype = torch.bfloat16,
    seq: int = PROBE_TOKENS,
    backend: str = "grouped_mm",
    compiled: bool = False,
) -> tuple[float, float]:
    """(dense block, MoE block) bytes the forward of `tokens` tokens keeps under `mode`, measured on the CPU;
    `compiled`: the blocks torch.compile'd as the trainer compiles them (trainer.compile).

    The probe runs each block at two token counts and two routed-expert counts; the bytes are linear in both
    (a + b*E + c*T + d*E*T: the constant is what the forward keeps per weight, e.g. autocast's bf16 copies of
    the weights saved for the backward; T*E the router's score tensors), so four forwards give the real shape's.
    A compiled block keeps what inductor's partitioner chose to keep, and under selective checkpointing only
    the results of the ops its code still calls (the GEMMs, attention): the policy sees no fused kernel. The CPU
    build of inductor makes the same choices, so the probe compiles there (it needs a C++ compiler; one to two
    minutes per mode on two cores)."""
    if mode not in MODES:
        raise PlanError(f"trainer.activation_checkpoint = {mode!r}: use one of {', '.join(MODES)}")
    k = mc.num_experts_per_tok
    e0, e1 = 2 * k, 4 * k
    # rows of min(seq, PROBE_TOKENS) tokens, one and two of them: attention keeps O(tokens) per row (as a fused
    # kernel keeps it, `fused_kernel_saves`), so the bytes are linear in the micro-batch's tokens
    s0 = min(seq, PROBE_TOKENS)
    b0, b1 = _probe_rows(compiled)
    t0, t1 = b0 * s0, b1 * s0
    key = (repr(mc), mode, str(dtype), str(s0), backend, str(compiled))
    if key not in _MEASURED:
        _MEASURED[key] = _measure(mc, mode, dtype, (e0, e1), s0, backend, compiled)
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
    mc: ModelConfig, mode: str, dtype: torch.dtype, es: tuple[int, int], s0: int, backend: str, compiled: bool
) -> dict[tuple[int, int], list[float]]:
    """The probe's bytes per (experts, tokens) corner: [dense block, MoE block], tokens in rows of s0."""
    f: dict[tuple[int, int], list[float]] = {}
    for e in es:
        model = probe_model(mc, e, backend)
        if compiled:
            compile_blocks(model)
        if backend != "reference" and dtype != torch.float32:
            for moe in model.moe_layers():  # the per-step copy the optimizer keeps (counted in the state, not here)
                moe.experts.weight_copy(dtype)
        angles = model.rope_angles[:PROBE_TOKENS].unsqueeze(0)
        cos = (angles.cos() * model.rope_scale)[:, :s0]
        sin = (angles.sin() * model.rope_scale)[:, :s0]
        for b in _probe_rows(compiled):
            t = b * s0
            figures = []
            for layer in model.model.layers:
                x = torch.randn(b, s0, mc.hidden_size, requires_grad=True)
                if compiled:
                    torch._dynamo.mark_dynamic(x, 0)  # one compile for both row counts

                def fwd(layer=layer, x=x, cos=cos, sin=sin):  # type: ignore[no-untyped-def]
                    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                        return run_block(layer, mode, x, cos, sin)

                with fused_kernel_saves():  # the backward too: checkpointing runs the forward again there
                    if compiled:  # compile this shape outside the measurement
                        _compile_probe(fwd)
                    figures.append(float(_net_forward_bytes(fwd)))
            f[(e, t)] = figures
        del model  # before the next probe is built: a DeepSeek-V3-wide probe is gigabytes
    return f


def _compile_probe(fwd) -> None:  # type: ignore[no-untyped-def]
    try:
        _net_forward_bytes(fwd)
    except Exception as exc:  # inductor's own errors (no C++ compiler, an unsupported op) have many types
        raise PlanError(
            "trainer.compile = true: the planner compiles its probe blocks with inductor on this CPU, which failed "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); install a C++ compiler (g++), "
            "or plan with --set trainer.compile=false (eager blocks keep more: an upper bound)"
        ) from exc


def _probe_rows(compiled: bool) -> tuple[int, int]:
    """The probe's two row counts: 1 and 2, or for compiled blocks 2 and 4 (a dynamic dimension of size 1 would be
    specialised, and a second compile would double the probe's time)."""
    return (2, 4) if compiled else (1, 2)


_MEASURED: dict[tuple[str, ...], dict[tuple[int, int], list[float]]] = {}


def head_bytes(mc: ModelConfig, tokens: int, dtype: torch.dtype = torch.bfloat16) -> float:
    """Final norm, lm_head and the loss (cross-entropy over logits.float(), as trainer/core.py computes it):
    bytes per token the forward keeps, measured at the real vocabulary and width (once per shape: `suggest` plans
    many token counts, and a DeepSeek-V3 head is 3.7 GB to build)."""
    key = (mc.hidden_size, mc.vocab_size, str(dtype))
    if key not in _HEAD:
        _HEAD[key] = _measure_head(mc, dtype)
    at8, per_token = _HEAD[key]
    return at8 + per_token * (tokens - 8)


_HEAD: dict[tuple[int, int, str], tuple[float, float]] = {}


def _measure_head(mc: ModelConfig, dtype: torch.dtype) -> tuple[float, float]:
    """The head's bytes at 8 tokens, and per token more."""
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
    return measured[0], (measured[1] - measured[0]) / 8


def plan(
    cfg: Config,
    gpus: int,
    ep: int | None = None,
    mode: str | None = None,
    rows: int | None = None,
    dp_shard: int | None = None,
    seq: int | None = None,
    accumulating: bool | None = None,
) -> Plan:
    """The bytes one of `gpus` ranks holds for `cfg` (ep, dp_shard, AC mode, rows per micro-batch per rank, whether
    an update takes several micro-batches: the config's unless given; RL's updates are taken to)."""
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
    backend = probe_backend(cfg)
    # the bf16 copy of the routed experts' fp32 masters (2 bytes a weight), or the FP8 pack (1 byte a weight,
    # stored and transposed): trainer/model/moe.py ExpertWeights
    copy = expert_p // 2 if backend != "reference" else 0
    dense_b, moe_b = block_bytes(mc, mode, tokens, dtype, seq, backend, tc.compile)
    n_dense = min(mc.first_k_dense, mc.num_layers) if mc.n_routed_experts else mc.num_layers
    # + the embedding's output (fp32: autocast leaves embeddings alone), the first block's input, and the token ids
    # its backward keeps
    embed = tokens * (mc.hidden_size * 4 + 8)
    act = int(n_dense * dense_b + (mc.num_layers - n_dense) * moe_b + head_bytes(mc, tokens, dtype) + embed)
    width = 2 if dtype == torch.bfloat16 else 4
    comm = 0 if ep == 1 else 2 * tokens * mc.num_experts_per_tok * mc.hidden_size * width
    # The backward's start above the kept activations: the loss's gradient of the logits (fp32, then the bf16
    # gradient lm_head's backward takes: T x V x (4 + 2) bytes), or, under checkpointing, the last MoE block's
    # forward run again with everything it keeps, whichever is larger (they are not live together).
    recompute = 0 if mode == "none" else int(block_bytes(mc, "none", tokens, dtype, seq, backend, tc.compile)[1])
    transient = max(tokens * mc.vocab_size * (4 + width), recompute)
    if accumulating is None:
        accumulating = tc.mode != "pretrain" or tc.optim.grad_accum > 1
    return Plan(dense_p, expert_p, copy, grads, opt, act, comm, transient, recompute, tokens, mode, accumulating)


def probe_backend(cfg: Config) -> str:
    """The expert backend the probe runs, the one the trainer runs on a GPU: `reference` where the config asks for
    it (under bf16 autocast it casts the fp32 masters per call, and autograd keeps the casts) or the compute is
    fp32 (torch._grouped_mm takes bf16 only on CUDA), else `grouped_mm`, which reads the per-step weight copy as
    every GPU backend does (cutedsl's bf16 GEMMs keep what grouped_mm keeps; its FP8 variant is counted as bf16,
    an upper bound)."""
    tc = cfg.trainer
    return "reference" if tc.experts.backend == "reference" or tc.dtype != "bfloat16" else "grouped_mm"


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
                    accumulating = rows < rows0 or None  # fewer rows per micro-batch: more micro-batches per update
                    p = plan(cfg, gpus, ep=ep, mode=mode, rows=rows, dp_shard=dp_shard, accumulating=accumulating)
                    if p.total <= gpu_gib * GiB:
                        return (
                            f"fits with: trainer.parallel.ep={ep} trainer.parallel.dp_shard={dp_shard} "
                            f"trainer.activation_checkpoint={mode} rows/micro-batch/rank={rows}: "
                            f"{p.total / GiB:.1f} GiB"
                        )
                    rows //= 2
    return "no choice of ep, AC mode, rows and dp_shard fits: more GPUs or a larger --gpu-memory"
