"""Token positions per RL step, packed (trainer.pack) against padded, for a config's sample-length mix: the
step's prompts through the tiny kit's tokenizer, each completion its reference answer and EOS (what a
warmed-up policy emits) or, with --completion max, rollout.max_tokens long. Rows are packed per PPO
mini-batch over --world ranks as the RL driver packs them (trainer/pack.py); padding is one row per sample of
the step's longest, as trainer.rl.batch.padded_batch pads. No model runs: the positions are a count.

    PYTHONPATH=. python bench/pack_positions.py configs/demo.toml --world 2 --budgets 0 32 64
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from tokenizers import Tokenizer

from common.config import load_config
from rollout.tasks.load import load_task
from trainer.pack import pack_rows
from trainer.rl.update import mini_batch_rows
from trainer.tinykit import build_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("config")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--budgets", type=int, nargs="+", default=[0, 32, 64], help="trainer.pack_tokens values")
    ap.add_argument("--completion", choices=["answer", "max"], default="answer")
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    cfg = load_config(args.config)
    out = Path(tempfile.mkdtemp())
    build_tokenizer(out)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    task = load_task(cfg.rollout.task)
    P, S = cfg.flow.prompts_per_step, cfg.flow.samples_per_prompt
    for step in range(args.steps):
        lengths = []
        for i in range(P):
            problem = task.problem(step * P + i)
            prompt = len(tok.encode(problem.prompt, add_special_tokens=False).ids)
            answer = len(tok.encode(problem.answer, add_special_tokens=False).ids) + 1
            completion = min(answer, cfg.rollout.max_tokens) if args.completion == "answer" else cfg.rollout.max_tokens
            lengths += [prompt + completion] * S
        padded = len(lengths) * max(lengths)
        figures = []
        for budget in args.budgets:
            n_rows, width = 0, 0
            for part in mini_batch_rows([S] * P, cfg.trainer.rl.mini_batches):
                rows = pack_rows(lengths[part], budget or max(lengths), args.world)
                n_rows += len(rows)
                width = max(width, *(sum(lengths[part][i] for i in row) for row in rows))
            positions = n_rows * width  # the driver pads every mini-batch's rows to the step's longest row
            figures.append(f"pack_tokens={budget}: {positions} ({positions / padded:.2f}x)")
        print(
            f"step {step}: {len(lengths)} samples, lengths {min(lengths)}..{max(lengths)}, tokens {sum(lengths)}, "
            f"padded {padded}; packed " + ", ".join(figures),
            flush=True,
        )


if __name__ == "__main__":
    main()
