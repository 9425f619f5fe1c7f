"""In-process learning check of the RL objective on the demo's task: the demo's warm start, then RL steps with
the policy sampling its own completions in torch (on-policy, temperature 1, no vLLM), and the held-out
arithmetic benchmark (greedy) before and after. Compares trainer.rl.algorithm = grpo and ppo (and any --set)
on the same warm start and sampling seed; it measures what the objective learns, not the system's timing.
Rows are packed as the trainer packs them (trainer.pack, default on where exact; `--set trainer.pack=false`
pads): each RL step prints the token positions its forwards compute packed and padded.

    PYTHONPATH=. python bench/ppo_learning.py --steps 15 --set trainer.rl.algorithm=ppo
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from common.config import load_config
from evaluator.benchmark import load_benchmark
from rollout.tasks.load import load_task
from trainer.core import TrainingCore, cross_entropy_loss
from trainer.pack import pack_batch
from trainer.ranks import Ranks
from trainer.rl.advantages import group_advantages, zero_variance_groups
from trainer.rl.batch import packed_warm_start_batch, warm_start_batch
from trainer.rl.critic import build_critic, copy_trunk, ppo_step, value_model
from trainer.rl.update import mini_batch_rows, proximal_fn, rl_updates
from trainer.setup import initial_model
from trainer.tinykit import resolve_model

LAST = 3


@torch.no_grad()
def sample(model, prompts: list[list[int]], max_tokens: int, eos: int, pad: int, greedy: bool, gen: torch.Generator):
    """Completions (token ids, log-probs) of each prompt; prompts of one length decode together."""
    model.eval()
    out: list[tuple[list[int], list[float]]] = [([], [])] * len(prompts)
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    for idx in by_len.values():
        seqs = torch.tensor([prompts[i] for i in idx])
        done = torch.zeros(len(idx), dtype=torch.bool)
        toks, lps = [], []
        for _ in range(max_tokens):
            logp = torch.log_softmax(model(seqs)[:, -1].float(), -1)
            nxt = logp.argmax(-1) if greedy else torch.multinomial(logp.exp(), 1, generator=gen).squeeze(1)
            nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
            toks.append(torch.where(done, torch.full_like(nxt, -1), nxt))
            lps.append(logp.gather(1, nxt[:, None]).squeeze(1))
            seqs = torch.cat([seqs, nxt[:, None]], 1)
            done |= nxt == eos
            if done.all():
                break
        T, L = torch.stack(toks, 1), torch.stack(lps, 1)
        for j, i in enumerate(idx):
            keep = T[j] >= 0
            out[i] = (T[j][keep].tolist(), L[j][keep].tolist())
    model.train()
    return out


def heldout(model, tok, cases, bench) -> float:
    prompts = [list(tok(c.prompt)["input_ids"]) for c in cases]
    outs = sample(model, prompts, cases[0].sampling.max_tokens, tok.eos_token_id, tok.pad_token_id, True, None)
    texts = [tok.decode(ids, skip_special_tokens=True) for ids, _ in outs]
    return sum(bench.score(c, t).values["accuracy"] for c, t in zip(cases, texts, strict=True)) / len(cases)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--heldout-count", type=int, default=0, help="held-out problems (0: the shipped file's)")
    args = ap.parse_args()
    cfg = load_config("configs/demo.toml", [f"trainer.steps={max(args.steps, 50)}", *args.set])
    rl, w = cfg.trainer.rl, cfg.trainer.warmup
    torch.manual_seed(0)
    run_dir = Path(tempfile.mkdtemp())
    model_dir = resolve_model(cfg, run_dir)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    cpu = torch.device("cpu")
    ranks = Ranks.single(cpu)
    core = TrainingCore(cfg, ranks, initial_model(cfg, cpu, model_dir))
    critic = build_critic(cfg, ranks, core.model) if rl.algorithm == "ppo" else None
    task = load_task(cfg.rollout.task)
    t0 = time.time()
    for step in range(w.steps):
        batch, n = warm_start_batch(task, tok, step, w.batch_size, cfg.rollout.chat_template)
        if cfg.trainer.packs():
            batch = packed_warm_start_batch(batch, cfg.trainer.pack_tokens, 1, tok.pad_token_id)
        core.step(batch, cross_entropy_loss(n), w.batch_size, tokens=0, lr=w.lr)
    core.optimizer.reset_moments()
    if critic is not None:
        copy_trunk(core.model, value_model(critic.model))
    data_root = Path("evaluator/data")
    if args.heldout_count:  # the shipped held-out file with another count, as the end-to-end test's 800
        spec = json.loads((data_root / "arithmetic" / "heldout.json").read_text()) | {"count": args.heldout_count}
        data_root = run_dir / "eval_data"
        (data_root / "arithmetic").mkdir(parents=True)
        (data_root / "arithmetic" / "heldout.json").write_text(json.dumps(spec))
    bench = load_benchmark("arithmetic", data_root, cfg.rollout.task)
    cases = bench.cases()
    start = heldout(core.model, tok, cases, bench)
    print(f"warm start {time.time() - t0:.0f}s held-out {start:.3f}", flush=True)
    gen = torch.Generator().manual_seed(args.seed)
    P, S = cfg.flow.prompts_per_step, cfg.flow.samples_per_prompt
    tail: list[float] = []  # held-out after each of the last LAST steps (the end-to-end tests' end of a run)
    for step in range(args.steps):
        problems = [task.problem(step * P + i) for i in range(P)]
        prompts = [list(tok(p.prompt)["input_ids"]) for p in problems for _ in range(S)]
        outs = sample(core.model, prompts, cfg.rollout.max_tokens, tok.eos_token_id, tok.pad_token_id, False, gen)
        rewards = torch.tensor(
            [
                task.reward(problems[i // S], tok.decode(ids, skip_special_tokens=True))
                for i, (ids, _) in enumerate(outs)
            ]
        ).view(P, S)
        keep = ~zero_variance_groups(rewards) if rl.filter_zero_variance else torch.ones(P, dtype=torch.bool)
        rows = [g * S + s for g in range(P) if keep[g] for s in range(S)]
        if not rows:
            continue
        seqs = [prompts[r] + outs[r][0] for r in rows]
        L = max(map(len, seqs))
        B = len(rows)
        tokens = torch.full((B, L), tok.pad_token_id)
        targets = torch.full((B, L), -1)
        behaviour = torch.zeros(B, L)
        for b, r in enumerate(rows):
            p, c = len(prompts[r]), len(outs[r][0])
            tokens[b, : p + c] = torch.tensor(seqs[b])
            targets[b, p - 1 : p - 1 + c] = torch.tensor(outs[r][0])
            behaviour[b, p - 1 : p - 1 + c] = torch.tensor(outs[r][1])
        mask = (targets >= 0).float()
        signal = rewards if rl.algorithm == "ppo" else group_advantages(rewards, rl.normalize_std)
        batch = {
            "tokens": tokens,
            "targets": targets,
            "behaviour": behaviour,
            "mask": mask,
            "rewards" if rl.algorithm == "ppo" else "advantages": signal[keep].flatten(),
            "fresh": torch.ones(B),
            "step_tokens": torch.full((B,), float(mask.sum())),
            # The torch sampler above draws at temperature 1 from the whole distribution.
            "temperature": torch.ones(B),
            "top_k": torch.full((B,), -1, dtype=torch.long),
            "top_p": torch.ones(B),
        }
        mbs = mini_batch_rows([S] * int(keep.sum()), rl.mini_batches)
        padded_positions = tokens.numel()
        if cfg.trainer.packs():
            lengths = [len(s) for s in seqs]
            fill = {"tokens": tok.pad_token_id, "targets": -1, "temperature": 1, "top_p": 1}
            batch, mbs = pack_batch(batch, lengths, mbs, cfg.trainer.pack_tokens or L, 1, fill)
        positions = f"positions {batch['tokens'].numel()} (padded {padded_positions})"
        if critic is not None:
            result = ppo_step(core, critic, batch, mbs, rl, train_policy=step >= rl.critic.warmup_steps)
        else:
            result = core.step_updates(rl_updates(batch, mbs, rl), rl.micro_batch_samples, prepare=proximal_fn(rl))
        f = result.figures
        extra = " ".join(
            f"{k.split('/')[-1]}={f[k]:.3g}"
            for k in ("critic/value_loss", "critic/explained_variance", "critic/value_mean", "rl/advantage_std")
            if k in f
        )
        print(
            f"step {step} reward {float(rewards.mean()):.3f} groups {int(keep.sum())} {positions} {extra}", flush=True
        )
        if step >= args.steps - LAST:
            tail.append(heldout(core.model, tok, cases, bench))
    end = tail[-1]
    mean = sum(tail) / len(tail)
    print(
        f"RESULT {rl.algorithm} {args.set} seed {args.seed} held-out {start:.3f} -> {end:.3f} "
        f"({100 * (end - start):+.1f} points; the last {len(tail)} versions' mean {mean:.3f}, "
        f"{100 * (mean - start):+.1f}) in {time.time() - t0:.0f}s",
        flush=True,
    )


if __name__ == "__main__":
    main()
