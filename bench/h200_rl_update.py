"""The RL update through the training core on synthetic rollouts: tokens/s and MFU.

Runs exactly what every trainer rank executes for an RLStep command (trainer.commands.TrainerRank.rl_step): the
decoupled PPO loss of trainer.rl.update through trainer.core.TrainingCore.step_updates, i.e. a no-grad
proximal log-prob forward over every micro-batch (eval mode), then forward + backward per micro-batch,
then the optimizer step (clipping, router-bias update, WSD). One rank (Ranks.single), no role path.

Synthetic rollouts: N rows of L tokens, random ids; targets = tokens shifted left (last column -1), the
first P positions of every row a prompt (target -1, not trained); behaviour log-probs around -2 (0 where
not trained); mask = targets >= 0; advantages +-1; fresh = 0; step_tokens = the trained-token count.
The batch stays on the CPU as the trainer's does (the core moves each micro-batch to the device).
--lengths longtail: rollout lengths from a seeded long tail instead (`rollout_lengths`): P prompt tokens plus
a lognormal completion (sigma 1, mean max(L/4 - P, (L - P)/8) before clipping to 1..L - P), one row of
exactly L so the padded layout is N x L as with fixed lengths; each row's tokens after its length are padding.

--compare-pack: in one process, the same rollouts padded (one row each, the longest's width) and packed as the
trainer packs an RL step (trainer.rl.batch.packed_rl_batch, budget the longest sample: trainer.pack_tokens = 0,
each PPO mini-batch on its own), each through warm-up + measured steps, then one table: rows, positions, trained
tokens, step ms, trained tokens/s, peak GiB, packed/padded throughput, and which attention each used. Both
start from the same weights (the model's state saved on the CPU and restored, AdamW's moments and the step
count reset between layouts), so their first steps' losses must agree (fp32: ~1e-6; bf16: rounding). A
failure of the packed layout prints its traceback; the padded row is printed all the same.

MFU: model FLOPs over all N * L positions (the forward runs over prompt tokens too; logits and
backward of untrained positions are computed all the same): fwd + bwd (6 x active params + causal
attention, trainer.model.attention_flops_per_token) plus the proximal forward (2 x active + a third of
that attention figure), over the H200's 989 TFLOP/s dense bf16 peak (bench/moe_bench.py's accounting).

    python bench/h200_rl_update.py                      # configs/moonlet.toml, N 32, R 16, L 4096 on cuda
    python bench/h200_rl_update.py --smoke              # configs/tiny.toml on the CPU, 1 step (plumbing)
    python bench/h200_rl_update.py --mini-batches 2     # two PPO updates per step (trainer.rl.mini_batches)
    python bench/h200_rl_update.py --lengths longtail --compare-pack   # packed vs padded on a long tail
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import trainer.model.transformer as transformer_module  # noqa: E402
from common.config import load_config  # noqa: E402
from trainer.core import TrainingCore  # noqa: E402
from trainer.experts import select_backend  # noqa: E402
from trainer.model import attention_flops_per_token, build_model, count_params  # noqa: E402
from trainer.model.attention import DocumentMask  # noqa: E402
from trainer.ranks import Ranks  # noqa: E402
from trainer.rl.batch import packed_rl_batch  # noqa: E402
from trainer.rl.update import proximal_fn, rl_updates  # noqa: E402

H200_PEAK = 989e12


def rollout_lengths(kind: str, n: int, seq: int, prompt: int, seed: int = 0) -> list[int]:
    """Each rollout's tokens: `seq` for "fixed"; for "longtail", `prompt` plus a lognormal completion (sigma 1,
    mean max(seq/4 - prompt, (seq - prompt)/8) before clipping to 1..seq - prompt) and one row (a seeded pick)
    of exactly `seq`, so that the padded layout's width is `seq` whatever the draw."""
    if kind == "fixed":
        return [seq] * n
    gen = torch.Generator().manual_seed(seed + 1)
    room = seq - prompt
    mean = max(seq / 4 - prompt, room / 8, 1.0)
    sigma = 1.0
    drawn = torch.empty(n).log_normal_(math.log(mean) - sigma**2 / 2, sigma, generator=gen)
    lengths = [prompt + int(c) for c in drawn.round().clamp(1, room)]
    lengths[int(torch.randint(0, n, (1,), generator=gen))] = seq
    return lengths


def synthetic_batch(
    n: int, seq: int, prompt: int, vocab: int, seed: int = 0, lengths: list[int] | None = None
) -> dict[str, torch.Tensor]:
    """N synthetic rollouts of `seq` positions, on the CPU, shaped as RLTrainer._update's padded batch: row b
    holds lengths[b] tokens (default `seq`), padding (id 0, target -1, mask 0) after them."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n, seq), generator=gen)
    targets = torch.full_like(tokens, -1)
    targets[:, :-1] = tokens[:, 1:]
    targets[:, :prompt] = -1
    for b, length in enumerate(lengths or []):
        tokens[b, length:] = 0
        targets[b, length - 1 :] = -1  # the last token predicts nothing, as in a full row
    mask = (targets >= 0).float()
    behaviour = (-2.0 + 0.5 * torch.randn(n, seq, generator=gen)).clamp(max=0.0) * mask
    advantages = torch.randint(0, 2, (n,), generator=gen).float() * 2 - 1
    n_tokens = float(mask.sum())
    return {
        "tokens": tokens,
        "targets": targets,
        "behaviour": behaviour,
        "mask": mask,
        "advantages": advantages,
        "fresh": torch.zeros(n),
        "step_tokens": torch.full((n,), n_tokens),
        "temperature": torch.ones(n),
        "top_k": torch.zeros(n, dtype=torch.long),
        "top_p": torch.ones(n),
    }


class RecordedMask(DocumentMask):
    """DocumentMask that notes which attention it set up (flex attention's block mask, or SDPA's dense mask)."""

    built: list[str] = []

    def __init__(self, documents: torch.Tensor) -> None:
        super().__init__(documents)
        RecordedMask.built.append("flex" if self.flex is not None else "sdpa")


def compiled_graphs() -> tuple[int, int]:
    """(graphs torch.compile has made, graph breaks it has met) in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"]), int(sum(counters["graph_break"].values()))


def plain(v: object) -> object:
    """A figure as JSON holds it: a tensor as a float (one element) or a list."""
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    return v


def attention_used(device: torch.device, masks: list[str]) -> str:
    """The attention a layout's forwards ran, from the document masks they built (none: causal SDPA)."""
    if not masks:
        return "causal SDPA (cuDNN first)" if device.type == "cuda" else "causal SDPA (math)"
    kinds = sorted(set(masks))
    if kinds == ["flex"]:
        return f"flex attention with a document block mask (compiled), {len(masks)} masks"
    return f"SDPA with a dense document mask, {len(masks)} masks" if kinds == ["sdpa"] else f"mixed: {kinds}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/moonlet.toml")
    ap.add_argument("--set", action="append", default=[], help="extra config overrides (key=value)")
    ap.add_argument("--rows", type=int, default=32, help="N rollouts per step")
    ap.add_argument("--rows-per-forward", type=int, default=16, help="R rows per micro-batch (packed rows too)")
    ap.add_argument("--seq", type=int, default=4096, help="L tokens per rollout (the longest, with --lengths longtail)")
    ap.add_argument("--prompt", type=int, default=512, help="P prompt positions per rollout (not trained)")
    ap.add_argument("--lengths", choices=("fixed", "longtail"), default="fixed", help="rollout lengths (docstring)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the synthetic tokens and lengths")
    ap.add_argument("--compare-pack", action="store_true", help="the same rollouts padded and packed, one table")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--mini-batches", type=int, default=1, help="K PPO updates per step (trainer.rl.mini_batches)")
    ap.add_argument("--batch-on", choices=("cpu", "device"), default="cpu")
    ap.add_argument("--profile", action="store_true", help="profile one more step (torch.profiler)")
    ap.add_argument("--profile-below", type=float, default=0.0, help="profile one more step if MFU is below this")
    ap.add_argument("--smoke", action="store_true", help="configs/tiny.toml on the CPU, tiny shapes, 1 step")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "h200_rl_update.json"))
    args = ap.parse_args()

    overrides = ["trainer.compile=true", *args.set]
    if args.smoke:
        args.config = "configs/tiny.toml"
        overrides = ["trainer.compile=false", "trainer.device=cpu", *args.set]
        args.rows, args.rows_per_forward, args.seq, args.prompt = 4, 2, 64, 8
        args.warmup, args.steps = 1, 1
        args.profile = not args.compare_pack
    cfg = load_config(args.config, overrides)
    tc, mc = cfg.trainer, cfg.trainer.model
    device = torch.device("cuda" if tc.device in ("cuda", "auto") and torch.cuda.is_available() else "cpu")
    compute = torch.bfloat16 if tc.dtype == "bfloat16" else torch.float32
    backend = select_backend(tc.experts.backend if device.type == "cuda" else "auto", device, compute)
    print(
        f"config {args.config} {overrides} device {device} dtype {tc.dtype} experts {backend} "
        f"compile {tc.compile} torch {torch.__version__}",
        flush=True,
    )

    model = build_model(mc, backend, seed=None, device=device)  # as bench/moe_bench.py: fast normal init
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0, 0.02)
    core = TrainingCore(cfg, Ranks.single(device), model)
    transformer_module.DocumentMask = RecordedMask  # type: ignore[misc]  # notes each forward's attention

    N, R, L, P = args.rows, args.rows_per_forward, args.seq, args.prompt
    if not 0 < P < L:
        raise SystemExit(f"--prompt {P} must be in 1..--seq {L} - 1")
    lengths = rollout_lengths(args.lengths, N, L, P, args.seed)
    batch = synthetic_batch(N, L, P, mc.vocab_size, args.seed, lengths if args.lengths != "fixed" else None)
    n_tokens = int(batch["mask"].sum())
    K = args.mini_batches
    if not 1 <= K <= N:
        raise SystemExit(f"--mini-batches {K} must be in 1..--rows {N}")
    rows_of = [slice(i * N // K, (i + 1) * N // K) for i in range(K)]  # the synthetic rows are groups of one
    print(
        f"N {N} rollouts, lengths {args.lengths} (mean {sum(lengths) / N:.0f}, max {max(lengths)}), prompt {P}, "
        f"trained tokens {n_tokens}, R {R} rows per forward, K {K} mini-batches; batch on {args.batch_on}",
        flush=True,
    )

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def step_fn(b: dict[str, torch.Tensor], rows: list[slice]) -> Callable[[], object]:
        if args.batch_on == "device":
            b = {k: v.to(device) for k, v in b.items()}

        def one_step():
            updates = rl_updates(b, rows, tc.rl)
            return core.step_updates(updates, rows_per_forward=R, prepare=proximal_fn(tc.rl))

        return one_step

    def measure(layout: str, b: dict[str, torch.Tensor], rows: list[slice]) -> tuple[dict, Callable[[], object]]:
        """Warm-up and measured steps of one layout of the rollouts; its record (JSON values only)."""
        one_step = step_fn(b, rows)
        micro = sum(len(core.my_micro_batches(u.batch, R)) for u in rl_updates(b, rows, tc.rl))
        positions = b["tokens"].numel()
        print(
            f"[{layout}] {b['tokens'].shape[0]} rows x {b['tokens'].shape[1]} positions = {positions}, "
            f"{micro} micro-batches (+ {micro} proximal forwards)",
            flush=True,
        )
        RecordedMask.built = []
        graphs, breaks = compiled_graphs()
        warm, first = [], {}
        for i in range(args.warmup):
            t0 = time.perf_counter()
            res = one_step()
            sync()
            warm.append(time.perf_counter() - t0)
            if i == 0:
                first = {"loss": res.figures.get("loss", math.nan), "grad_norm": res.optim.grad_norm}
            print(
                f"[{layout}] warm-up step {i + 1}: {warm[-1]:.2f} s loss {res.figures.get('loss', math.nan):.6g} "
                f"grad_norm {res.optim.grad_norm:.6g}",
                flush=True,
            )
        attention = attention_used(device, RecordedMask.built)
        graphs_after, breaks_after = compiled_graphs()
        if tc.compile:  # what torch.compile made of this layout's warm-up: new graphs (recompiles) and graph breaks
            attention += f"; compile: {graphs_after - graphs} new graphs, {breaks_after - breaks} graph breaks"
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        per_step = []
        sync()
        t_all = time.perf_counter()
        for _ in range(args.steps):
            t0 = time.perf_counter()
            res = one_step()
            sync()
            per_step.append(time.perf_counter() - t0)
            if not first:  # no warm-up: the first measured step is the first
                first = {"loss": res.figures.get("loss", math.nan), "grad_norm": res.optim.grad_norm}
        dt = (time.perf_counter() - t_all) / args.steps
        return {
            "layout": layout,
            "rows": int(b["tokens"].shape[0]),
            "width": int(b["tokens"].shape[1]),
            "positions": int(positions),
            "trained_tokens": int(b["mask"].sum()),
            "micro_batches": micro,
            "attention": attention,
            "warmup_s": warm,
            "step_s": per_step,
            "step_ms_mean": dt * 1e3,
            "step_ms_median": sorted(per_step)[len(per_step) // 2] * 1e3,
            "tokens_per_s": positions / dt,
            "trained_tokens_per_s": int(b["mask"].sum()) / dt,
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None,
            "first_loss": float(first["loss"]),
            "first_grad_norm": float(first["grad_norm"]),
            "last_figures": {k: plain(v) for k, v in res.figures.items()},
            "grad_norm": float(res.optim.grad_norm),
        }, one_step

    start = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()} if args.compare_pack else {}
    padded, padded_step = measure("padded", batch, rows_of)
    dt = padded["step_ms_mean"] / 1e3
    total_params, active = count_params(mc)
    attn = attention_flops_per_token(mc, L)  # fwd + bwd
    train_flops = (6 * active + attn) * padded["positions"]
    prox_flops = (2 * active + attn / 3) * padded["positions"]
    step_flops = train_flops + prox_flops
    out = {
        "config": args.config,
        "overrides": overrides,
        "device": str(device),
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "N": N,
        "R": R,
        "L": L,
        "P": P,
        "lengths": args.lengths,
        "rollout_lengths": lengths,
        "mini_batches": K,
        "micro_batches": padded["micro_batches"],
        "batch_on": args.batch_on,
        "trained_tokens": n_tokens,
        "params_total": total_params,
        "params_active": active,
        "warmup_s": padded["warmup_s"],
        "step_s": padded["step_s"],
        "step_ms_mean": padded["step_ms_mean"],
        "step_ms_median": padded["step_ms_median"],
        "tokens_per_s": padded["tokens_per_s"],
        "trained_tokens_per_s": padded["trained_tokens_per_s"],
        "model_tflops_all": step_flops / dt / 1e12,
        "mfu_989_all": step_flops / dt / H200_PEAK,
        "mfu_989_fwd_bwd_only": train_flops / dt / H200_PEAK,
        "peak_mem_gib": padded["peak_mem_gib"],
        "last_figures": padded["last_figures"],
        "grad_norm": padded["grad_norm"],
    }
    print(json.dumps({k: v for k, v in out.items() if k not in ("last_figures", "rollout_lengths")}, indent=1))
    print(
        f"RESULT tokens/s {out['tokens_per_s']:,.0f} (trained {out['trained_tokens_per_s']:,.0f}) step "
        f"{dt * 1e3:.0f} ms MFU(all work) {out['mfu_989_all']:.1%} MFU(fwd+bwd only) "
        f"{out['mfu_989_fwd_bwd_only']:.1%} peak {gib(padded['peak_mem_gib'])} GiB (padded, MFU over every position)",
        flush=True,
    )
    if args.profile or out["mfu_989_all"] < args.profile_below:
        profile_step(padded_step, device, sync, Path(args.out))

    if args.compare_pack:
        out["layouts"] = [padded]
        packed: dict | None = None
        try:
            # Back to the weights the padded layout began from; a fresh AdamW and WSD position as well.
            model.load_state_dict(start)
            for opt in core.optimizer.optimizers:
                opt.state.clear()
            core.optimizer.steps, core.optimizer.tokens = 0, 0
            del start
            if device.type == "cuda":
                torch.cuda.empty_cache()
            packed_batch, packed_rows = packed_rl_batch(batch, lengths, rows_of, 0, 1, pad_id=0)
            packed, _ = measure("packed", packed_batch, packed_rows)
            if device.type == "cuda" and not packed["attention"].startswith("flex"):
                print(f"WARNING: packed rows on cuda did not run flex attention: {packed['attention']}", flush=True)
            out["layouts"].append(packed)
        except Exception as exc:
            traceback.print_exc()
            out["packed_error"] = f"{type(exc).__name__}: {exc}"
        out |= compare_table(padded, packed, out.get("packed_error", ""))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


def gib(peak: float | None) -> str:
    return "-" if peak is None else f"{peak:.2f}"


def compare_table(padded: dict, packed: dict | None, error: str) -> dict[str, float]:
    """Print the layouts' table, the throughput ratio and the first-step loss check; return the two figures."""
    head = f"{'layout':<8} {'rows':>5} {'positions':>10} {'trained':>9} {'step ms':>9} {'trained tok/s':>14} {'peak GiB':>9}"
    print(head, flush=True)
    for r in (padded, packed):
        if r is None:
            print(f"{'packed':<8} FAILED: {error}", flush=True)
            continue
        print(
            f"{r['layout']:<8} {r['rows']:>5} {r['positions']:>10} {r['trained_tokens']:>9} {r['step_ms_mean']:>9.1f} "
            f"{r['trained_tokens_per_s']:>14,.0f} {gib(r['peak_mem_gib']):>9}   attention: {r['attention']}",
            flush=True,
        )
    if packed is None:
        return {}
    ratio = packed["trained_tokens_per_s"] / padded["trained_tokens_per_s"]
    a, b = padded["first_loss"], packed["first_loss"]
    rel = abs(b - a) / max(abs(a), 1e-12)
    g = abs(packed["first_grad_norm"] - padded["first_grad_norm"]) / max(abs(padded["first_grad_norm"]), 1e-12)
    print(f"packed/padded trained tokens/s: {ratio:.3f}", flush=True)
    print(
        f"first step from the same weights: loss padded {a:.9g} packed {b:.9g} relative difference {rel:.2e}; "
        f"grad_norm relative difference {g:.2e}",
        flush=True,
    )
    return {"packed_over_padded_trained_tokens_per_s": ratio, "first_loss_rel_diff": rel, "first_grad_norm_rel_diff": g}


def profile_step(one_step: Callable[[], object], device: torch.device, sync: Callable[[], None], out: Path) -> None:
    """One more step under torch.profiler; its table printed and written beside --out."""
    from torch.profiler import ProfilerActivity, profile, record_function

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        with record_function("rl_step"):
            one_step()
            sync()
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=60)
    print(table, flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".profile.txt").write_text(table)


if __name__ == "__main__":
    main()
