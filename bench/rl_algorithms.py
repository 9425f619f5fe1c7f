"""The demo's RL algorithms side by side: GRPO, PPO with a critic, and PPO with a KL to the reference.

`--curves`: the demo (configs/demo.toml, `trainer.steps` RL steps) launched once per variant, one after the
other on this machine, and the held-out accuracy of every version and the KL to the reference at every step
read from each run's metrics: one table, one column per variant.
`--step-cost`: the RL step on the training core alone (no vLLM), the same batch for every variant in one
process, repeated and interleaved: what the critic (its forward, its update) and the reference's forward add
to a GRPO step, as ratios of the median step time.

Usage: python bench/rl_algorithms.py --curves [--steps 15] [--out DIR]
       python bench/rl_algorithms.py --step-cost [--rows 1024] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# name -> the --set overrides of the demo for that variant.
VARIANTS: dict[str, tuple[str, ...]] = {
    "grpo": (),
    "ppo": ("trainer.rl.algorithm=ppo", "trainer.rl.log_kl=true"),
    "ppo+kl": ("trainer.rl.algorithm=ppo", "trainer.rl.kl_coef=0.1"),
}
HELDOUT = "eval/arithmetic/accuracy/mean"
KL = "loss/kl_k3"


def launch(name: str, sets: tuple[str, ...], steps: int, root: Path) -> tuple[Path, float]:
    """Run the demo variant to its end; returns its run directory and wall-clock seconds."""
    cmd = [sys.executable, "-m", "common.runs.cli", "launch", "configs/demo.toml"]
    for s in (f"run.root={root}", f"trainer.steps={steps}", *sets):
        cmd += ["--set", s]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLIPSTREAM")} | {"SLIPSTREAM_EXP": name}
    t0 = time.monotonic()
    with (root / f"{name}.log").open("wb") as log:
        done = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"{name}: launch exited with {done.returncode}; see {root / f'{name}.log'}")
    return root / name, time.monotonic() - t0


def curves(steps: int, out: Path) -> None:
    from common.metrics import step_series

    runs = {name: launch(name, sets, steps, out) for name, sets in VARIANTS.items()}
    series = {name: step_series(run_dir, [HELDOUT, KL]) for name, (run_dir, _) in runs.items()}
    names = list(VARIANTS)
    print(f"demo, {steps} RL steps per variant; held-out accuracy per version (200 problems, greedy)")
    print("| version | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for v in range(steps + 1):
        cells = [series[n].get(HELDOUT, {}).get(v) for n in names]
        print(f"| {v} | " + " | ".join("-" if c is None else f"{c:.3f}" for c in cells) + " |")
    print("\nKL to the reference (k3, per token) at the same step")
    print("| step | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for s in range(steps):
        cells = [series[n].get(KL, {}).get(s) for n in names]
        print(f"| {s} | " + " | ".join("-" if c is None else f"{c:.3g}" for c in cells) + " |")
    print()
    for n in names:
        held = series[n].get(HELDOUT, {})
        last = [held[v] for v in range(steps - 2, steps + 1) if v in held]
        rise = (sum(last) / len(last) - held[0]) if last and 0 in held else float("nan")
        print(
            f"{n}: {runs[n][1]:.0f} s; held-out {held.get(0, float('nan')):.3f} at v0 -> mean of the last 3 "
            f"versions {sum(last) / max(len(last), 1):.3f} ({rise * 100:+.1f} points)"
        )


def demo_batch(rows: int, vocab: int, seed: int = 0) -> dict:
    """An RL step's batch shaped like the demo's: prompts of 8 tokens, completions of 1-6, groups of 16 with
    0/1 rewards, sampled at temperature 1."""
    import torch

    g = torch.Generator().manual_seed(seed)
    prompt, most = 8, 6
    length = prompt + most
    tokens = torch.randint(0, vocab, (rows, length), generator=g)
    targets = torch.full((rows, length), -1)
    n = torch.randint(1, most + 1, (rows,), generator=g)
    for b in range(rows):
        targets[b, prompt - 1 : prompt - 1 + int(n[b])] = tokens[b, prompt : prompt + int(n[b])]
    mask = (targets >= 0).float()
    return {
        "tokens": tokens,
        "targets": targets,
        "behaviour": -torch.rand(rows, length, generator=g) * mask,
        "mask": mask,
        "rewards": torch.randint(0, 2, (rows,), generator=g).float(),
        "fresh": torch.ones(rows),
        "step_tokens": torch.full((rows,), float(mask.sum())),
        "temperature": torch.ones(rows),
        "top_k": torch.zeros(rows, dtype=torch.long),
        "top_p": torch.ones(rows),
    }


def measure(rows: int, repeats: int) -> dict[str, list[float]]:
    """Seconds of each variant's RL step on the demo's model and RL settings, interleaved `repeats` times."""
    import torch

    from common.config import load_config
    from trainer.core import TrainingCore
    from trainer.model import build_model
    from trainer.ranks import Ranks
    from trainer.rl.advantages import group_advantages
    from trainer.rl.critic import build_critic, ppo_step
    from trainer.rl.reference import ReferencePolicy
    from trainer.rl.update import mini_batch_rows, proximal_fn, rl_updates

    torch.manual_seed(0)
    ranks = Ranks.single(torch.device("cpu"))
    group = 16
    variants = {"grpo": ("grpo", 0.0), "grpo+kl": ("grpo", 0.05), "ppo": ("ppo", 0.0), "ppo+kl": ("ppo", 0.05)}
    steps = {}
    for name, (algorithm, kl_coef) in variants.items():
        cfg = load_config(REPO / "configs" / "demo.toml", [f"trainer.rl.algorithm={algorithm}"])
        cfg.trainer.rl.kl_coef = kl_coef
        rl = cfg.trainer.rl
        core = TrainingCore(cfg, ranks, build_model(cfg.trainer.model, seed=0))
        reference = ReferencePolicy(core.model, None, ranks.device, torch.float32).model if kl_coef else None
        batch = demo_batch(rows, cfg.trainer.model.vocab_size)
        cuts = mini_batch_rows([group] * (rows // group), rl.mini_batches)
        if algorithm == "ppo":
            critic = build_critic(cfg, ranks, core.model)
            steps[name] = lambda c=core, k=critic, b=batch, r=cuts, x=rl, ref=reference: ppo_step(
                c, k, b, r, x, True, reference=ref
            )
        else:
            adv = group_advantages(batch.pop("rewards").view(-1, group)).flatten()
            batch["advantages"] = adv
            steps[name] = lambda c=core, b=batch, r=cuts, x=rl, ref=reference: c.step_updates(
                rl_updates(b, r, x), x.micro_batch_samples, prepare=proximal_fn(x, ref)
            )
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():  # one step each first: warm-up, not timed
        step()
    for _ in range(repeats):
        for name, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - t0)
    return times


def step_cost(rows: int, repeats: int) -> None:
    times = measure(rows, repeats)
    base = statistics.median(times["grpo"])
    print(f"RL step on the training core, demo model, {rows} rows; median of {repeats} interleaved steps")
    print("| variant | median s | x grpo |")
    print("|---|---|---|")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"| {name} | {med:.3f} | {med / base:.2f} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--curves", action="store_true")
    p.add_argument("--step-cost", action="store_true")
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=None, help="where the runs go (default: a new temporary directory)")
    args = p.parse_args()
    if not (args.curves or args.step_cost):
        p.error("say --curves and/or --step-cost")
    if args.step_cost:
        step_cost(args.rows, args.repeats)
    if args.curves:
        out = args.out or Path(tempfile.mkdtemp(prefix="rl_algorithms_"))
        out.mkdir(parents=True, exist_ok=True)
        curves(args.steps, out)


if __name__ == "__main__":
    main()
