"""The RL update through the training core on synthetic rollouts: tokens/s and MFU.

Runs exactly what every trainer rank executes for an RLStep command (trainer.commands.TrainerRank.rl_step): the
decoupled PPO loss of trainer.rl.update through trainer.core.TrainingCore.step_updates, i.e. a no-grad
proximal log-prob forward over every micro-batch (eval mode), then forward + backward per micro-batch,
then the optimizer step (clipping, router-bias update, WSD). One rank (Ranks.single), no role path.

Synthetic rollouts: N rows of L tokens, random ids; targets = tokens shifted left (last column -1), the
first P positions of every row a prompt (target -1, not trained); behaviour log-probs around -2 (0 where
not trained); mask = targets >= 0; advantages +-1; fresh = 0; step_tokens = the trained-token count.
The batch stays on the CPU as the trainer's does (the core moves each micro-batch to the device).

MFU: model FLOPs over all N * L positions (the forward runs over prompt tokens too; logits and
backward of untrained positions are computed all the same): fwd + bwd (6 x active params + causal
attention, trainer.model.attention_flops_per_token) plus the proximal forward (2 x active + a third of
that attention figure), over the H200's 989 TFLOP/s dense bf16 peak (bench/moe_bench.py's accounting).

    python bench/h200_rl_update.py                      # configs/moonlet.toml, N 32, R 16, L 4096 on cuda
    python bench/h200_rl_update.py --smoke              # configs/tiny.toml on the CPU, 1 step (plumbing)
    python bench/h200_rl_update.py --mini-batches 2     # two PPO updates per step (trainer.rl.mini_batches)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.config import load_config  # noqa: E402
from trainer.core import TrainingCore  # noqa: E402
from trainer.experts import select_backend  # noqa: E402
from trainer.model import attention_flops_per_token, build_model, count_params  # noqa: E402
from trainer.ranks import Ranks  # noqa: E402
from trainer.rl.update import proximal_fn, rl_updates  # noqa: E402

H200_PEAK = 989e12


def synthetic_batch(n: int, seq: int, prompt: int, vocab: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """N synthetic rollouts of `seq` tokens, on the CPU, shaped as RLTrainer._update's batch."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (n, seq), generator=gen)
    targets = torch.full_like(tokens, -1)
    targets[:, :-1] = tokens[:, 1:]
    targets[:, :prompt] = -1
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/moonlet.toml")
    ap.add_argument("--set", action="append", default=[], help="extra config overrides (key=value)")
    ap.add_argument("--rows", type=int, default=32, help="N rollouts per step")
    ap.add_argument("--rows-per-forward", type=int, default=16, help="R rows per micro-batch")
    ap.add_argument("--seq", type=int, default=4096, help="L tokens per rollout")
    ap.add_argument("--prompt", type=int, default=512, help="P prompt positions per rollout (not trained)")
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
        args.profile = True
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

    N, R, L, P = args.rows, args.rows_per_forward, args.seq, args.prompt
    batch = synthetic_batch(N, L, P, mc.vocab_size)
    if args.batch_on == "device":
        batch = {k: v.to(device) for k, v in batch.items()}
    n_tokens = int(batch["mask"].sum())
    micro = len(core.my_micro_batches(batch, R))
    print(
        f"N {N} rows x L {L} tokens, prompt {P}, trained tokens {n_tokens}, R {R} rows per forward "
        f"-> {micro} micro-batches (+ {micro} proximal forwards); batch on {args.batch_on}",
        flush=True,
    )

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    K = args.mini_batches
    if not 1 <= K <= N:
        raise SystemExit(f"--mini-batches {K} must be in 1..--rows {N}")
    rows_of = [slice(i * N // K, (i + 1) * N // K) for i in range(K)]  # the synthetic rows are groups of one

    def one_step():
        updates = rl_updates(batch, rows_of, tc.rl)
        return core.step_updates(updates, rows_per_forward=R, prepare=proximal_fn(tc.rl))

    warm = []
    for i in range(args.warmup):
        t0 = time.perf_counter()
        res = one_step()
        sync()
        warm.append(time.perf_counter() - t0)
        print(
            f"warm-up step {i + 1}: {warm[-1]:.2f} s loss {res.figures.get('loss', math.nan):.4g} "
            f"grad_norm {res.optim.grad_norm:.4g}",
            flush=True,
        )
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
    dt = (time.perf_counter() - t_all) / args.steps
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else math.nan

    total_params, active = count_params(mc)
    attn = attention_flops_per_token(mc, L)  # fwd + bwd
    positions = N * L
    train_flops = (6 * active + attn) * positions
    prox_flops = (2 * active + attn / 3) * positions
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
        "mini_batches": K,
        "micro_batches": micro,
        "batch_on": args.batch_on,
        "trained_tokens": n_tokens,
        "params_total": total_params,
        "params_active": active,
        "warmup_s": warm,
        "step_s": per_step,
        "step_ms_mean": dt * 1e3,
        "step_ms_median": sorted(per_step)[len(per_step) // 2] * 1e3,
        "tokens_per_s": positions / dt,
        "trained_tokens_per_s": n_tokens / dt,
        "model_tflops_all": step_flops / dt / 1e12,
        "mfu_989_all": step_flops / dt / H200_PEAK,
        "mfu_989_fwd_bwd_only": train_flops / dt / H200_PEAK,
        "peak_mem_gib": peak,
        "last_figures": res.figures,
        "grad_norm": res.optim.grad_norm,
    }
    print(json.dumps({k: v for k, v in out.items() if k not in ("last_figures",)}, indent=1), flush=True)
    print(
        f"RESULT tokens/s {out['tokens_per_s']:,.0f} (trained {out['trained_tokens_per_s']:,.0f}) step "
        f"{dt * 1e3:.0f} ms MFU(all work) {out['mfu_989_all']:.1%} MFU(fwd+bwd only) "
        f"{out['mfu_989_fwd_bwd_only']:.1%} peak {peak:.1f} GiB",
        flush=True,
    )

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    # The step's figures hold tensors: written as their values.
    Path(args.out).write_text(json.dumps(out, indent=1, default=lambda v: v.tolist() if torch.is_tensor(v) else str(v)))
    if args.profile or out["mfu_989_all"] < args.profile_below:
        from torch.profiler import ProfilerActivity, profile, record_function

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            with record_function("rl_step"):
                one_step()
                sync()
        key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
        table = prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=60)
        print(table, flush=True)
        Path(args.out).with_suffix(".profile.txt").write_text(table)


if __name__ == "__main__":
    main()
