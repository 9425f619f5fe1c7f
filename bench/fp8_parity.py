"""FP8 training parity (issue 16): moonlet (configs/moonlet.toml as is) trained twice from the same initial
weights on the same deterministic text in the same order, once with bf16 experts (torch._grouped_mm) and once
with FP8 experts (CuTeDSL, DeepSeek-V3 block scales; select_backend's "fp8"); the final losses, each the mean
of the last 20 steps, must agree within 1% (relative). Each run's steady steps (the first 10 left out) are
timed too: tokens/s and MFU counted as bench/moe_bench.py counts them (bf16-equivalent FLOPs over 989
TFLOP/s), so this also gives moonlet's MFU with FP8 experts. Writes fp8_parity.json (per-step losses and
times of both runs, the comparison) and fp8_parity.png (both loss curves and their relative difference)
under $OUT, and prints a markdown table last.

    python3 bench/fp8_parity.py [--steps 300 --batch 4 --seq 4096 --deadline-s 500]   # on the H200
    .venv/bin/python bench/fp8_parity.py --smoke        # configs/tiny.toml on the CPU: the plumbing only
    .venv/bin/python bench/fp8_parity.py --plot fp8_parity.json    # the PNG from a JSON, e.g. here

Corpus: the twelve phrasings of configs/data/word_problems.jsonl (plus and minus) with their two operands
replaced by 0..996 and 0..990 taken from a hash of the line number (BLAKE2b of j; no random generator), each
line followed by its answer, one document a line, tokenized by
the tiny kit's tokenizer (trainer/tinykit.py; 114 ids of moonlet's 32768) and packed into rows of seq + 1
tokens by trainer/pretrain.py's `token_rows`. Step i trains on rows [i B, (i + 1) B): no sampling, no seed.
Why hashed operands: with operands stepped by fixed strides (the first version) the model learned the
sequence, the loss fell to 0.05 and was still falling fast at step 300, where two bf16 runs differed by 3%
(2026-12-04); hashed operands are unpredictable, so the loss levels off near 1.0 nats/token and two bf16 runs
end within 0.001-1.05% of each other.
Initial weights: build_model's seeded N(0, 0.02) init, made once on the CPU and loaded into both runs.
Learning rate: the config's (peak 3e-4, AdamW, clipping, bias balancing) except its warmup, 50M tokens, which
would keep 300 steps of 16k tokens below a tenth of the peak: --warmup-steps (default 10% of the steps)
replaces it, -1 keeps it. Left out: a bf16 run against itself for the noise floor (--control adds it),
evaluation on held-out text, more than one seed.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import hashlib
import json
import math
import os
import re
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.moe_bench import H200_PEAK, model_flops_per_token  # noqa: E402
from common.config import ModelConfig, OptimConfig, load_config  # noqa: E402
from trainer.data.tokenizer import load_tokenizer  # noqa: E402
from trainer.experts import BackendUnavailable, select_backend  # noqa: E402
from trainer.model import build_model, compile_blocks  # noqa: E402
from trainer.optim import Optimizer, autocast  # noqa: E402
from trainer.pretrain import PretrainData, token_rows  # noqa: E402
from trainer.tinykit import build_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORD_PROBLEMS = ROOT / "configs" / "data" / "word_problems.jsonl"
TOLERANCE = 0.01  # relative difference of the final losses (issue 16)


@dataclass
class Run:
    """One training run: what it ran with, the loss and wall time of every step, and the steady rates."""

    label: str
    precision: str
    experts_backend: str
    losses: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)
    """Wall time of each step (forward, backward, optimizer step, the loss read back); the first compiles."""
    steady_step_ms: float = math.nan
    tokens_per_s: float = math.nan
    model_tflops: float = math.nan
    mfu_989: float = math.nan
    peak_mem_gib: float = math.nan
    stopped: str = ""
    """Why the run ended before its last step ("" if it did not)."""


def phrasings() -> list[str]:
    """The word-problem phrasings of configs/data/word_problems.jsonl, operands as {a} and {b}, in file order."""
    templates: dict[str, None] = {}
    for line in WORD_PROBLEMS.read_text().splitlines():
        prompt = re.sub(r"\d+", "{a}", json.loads(line)["prompt"], count=1)
        templates[re.sub(r"\d+", "{b}", prompt, count=1)] = None
    return list(templates)


def corpus_line(j: int, templates: list[str]) -> str:
    """Line j of the corpus: a phrasing (j mod 12) with operands from a hash of j, then its answer."""
    template = templates[j % len(templates)]
    digest = hashlib.blake2b(j.to_bytes(8, "little"), digest_size=8).digest()
    a, b = int.from_bytes(digest[:4], "little") % 997, int.from_bytes(digest[4:], "little") % 991
    return f"{template.format(a=a, b=b)} {a - b if 'minus' in template else a + b}"


def corpus_rows(n_rows: int, seq: int, workdir: Path) -> tuple[torch.Tensor, dict]:
    """At least n_rows training rows [n_rows, seq + 1] of the corpus, and a description of it."""
    tok_dir = workdir / "tok"
    build_tokenizer(tok_dir)
    templates = phrasings()
    # Enough lines for n_rows: the tokens per line of the first lines (+1 for the end-of-document id).
    encode, _ = load_tokenizer(tok_dir)
    per_line = sum(len(encode(corpus_line(j, templates))) + 1 for j in range(240)) / 240
    n_lines = int((n_rows * seq + 1) / per_line * 1.05) + 240
    path = workdir / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": corpus_line(j, templates)}) + "\n" for j in range(n_lines)))
    rows = token_rows(PretrainData(str(path), seq, 1, tokenizer=str(tok_dir)))
    if len(rows) < n_rows:
        raise RuntimeError(f"the corpus gave {len(rows)} rows of {seq + 1} tokens, {n_rows} needed: raise the margin")
    about = {
        "lines": n_lines,
        "tokens_trained": n_rows * seq,
        "tokens_per_line": per_line,
        "phrasings": len(templates),
        "first_lines": [corpus_line(j, templates) for j in range(4)],
    }
    return torch.from_numpy(rows[:n_rows]), about


def train(
    run: Run,
    mc: ModelConfig,
    optim: OptimConfig,
    init_state: dict,
    rows: torch.Tensor,
    batch: int,
    compiled: bool,
    skip: int,
    stop_at: float,
    device: torch.device,
) -> None:
    """Train a fresh model from `init_state` with run.experts_backend on consecutive batches of `rows`,
    recording into `run`; stops early (run.stopped) once time.perf_counter() passes `stop_at`."""
    model = build_model(mc, run.experts_backend, seed=None, device=device)
    model.load_state_dict(init_state)
    if compiled:
        torch._dynamo.reset()  # the other run's graphs (another experts backend) must not count to the limit
        compile_blocks(model)
    opt = Optimizer(model, optim)
    seq = rows.shape[1] - 1
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for step in range(len(rows) // batch):
        if time.perf_counter() > stop_at:
            run.stopped = f"soft deadline reached before step {step}"
            print(f"{run.label}: {run.stopped}", flush=True)
            break
        t0 = time.perf_counter()
        tokens = rows[step * batch : (step + 1) * batch]
        with autocast(device, "bfloat16"):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step(batch * seq)
        run.losses.append(float(loss.detach()))  # a sync: the step's time is its whole time
        run.step_ms.append((time.perf_counter() - t0) * 1e3)
        if step % 25 == 0 or step == len(rows) // batch - 1:
            print(f"{run.label} step {step}: loss {run.losses[-1]:.4f} ({run.step_ms[-1]:.0f} ms)", flush=True)
    steady = run.step_ms[skip:]
    if steady:
        run.steady_step_ms = sum(steady) / len(steady)
        run.tokens_per_s = batch * seq / (run.steady_step_ms / 1e3)
        achieved = model_flops_per_token(mc, seq) * run.tokens_per_s
        run.model_tflops, run.mfu_989 = achieved / 1e12, achieved / H200_PEAK
    if device.type == "cuda":
        run.peak_mem_gib = torch.cuda.max_memory_allocated() / 2**30


def compare(base: Run, other: Run, last: int, steps: int) -> dict:
    """The final losses (means of the last `last` steps both runs reached) and their relative difference; a
    pass needs both runs to have reached all `steps` steps."""
    n = min(len(base.losses), len(other.losses))
    if n < last:
        return {"pass": False, "why": f"only {n} steps in both runs, fewer than the {last} compared"}
    final_base = sum(base.losses[n - last : n]) / last
    final_other = sum(other.losses[n - last : n]) / last
    rel = (final_other - final_base) / final_base
    return {
        "steps": n,
        "last": last,
        "final_" + base.label: final_base,
        "final_" + other.label: final_other,
        "rel_diff": rel,
        "tolerance": TOLERANCE,
        "pass": abs(rel) <= TOLERANCE and n == steps,
        "why": "" if n == steps else f"incomplete: {n} of {steps} steps in both runs",
    }


def plot(result: dict, path: Path) -> None:
    """Both loss curves against the step (log loss) and, below, each run's relative difference to the first."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import PercentFormatter, ScalarFormatter

    runs = result["runs"]
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1.3]})
    colors = {r["label"]: f"C{i}" for i, r in enumerate(runs)}  # a run keeps its colour in both panels
    for r in runs:
        ax.plot(r["losses"], lw=1, color=colors[r["label"]], label=f"{r['label']} experts ({r['experts_backend']})")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(ScalarFormatter())
    ax.set_ylabel("training loss (nats/token, log scale)")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    base = runs[0]["losses"]
    for r in runs[1:]:
        n = min(len(base), len(r["losses"]))
        ax2.plot(
            [(r["losses"][i] - base[i]) / base[i] for i in range(n)],
            lw=0.8,
            color=colors[r["label"]],
            label=f"{r['label']} vs {runs[0]['label']}",
        )
    for y in (-TOLERANCE, TOLERANCE):
        ax2.axhline(y, color="gray", ls="--", lw=0.8)
    ax2.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax2.set_ylabel("relative difference")
    ax2.set_xlabel("step")
    ax2.grid(alpha=0.3)
    if len(runs) > 1:
        ax2.legend(fontsize=8)
    c = result.get("comparison", {})
    verdict = (
        f"final (last {c['last']} of {c['steps']} steps) {c['rel_diff']:+.2%}: {'pass' if c['pass'] else 'FAIL'} at "
        f"{TOLERANCE:.0%} {c['why']}"
        if "rel_diff" in c
        else c.get("why", "no comparison")
    )
    a = result["args"]
    ax.set_title(f"{result['model']}, {a['batch']}x{a['seq']} tokens/step, {result['device']}\n{verdict}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}", flush=True)


def markdown(result: dict) -> str:
    lines = [
        "| run | experts | steps | final loss (mean of its last N) | steady step ms | tokens/s | MFU (989) | peak GiB | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    c = result.get("comparison", {})
    last = result["args"]["last"]
    for r in result["runs"]:
        final = sum(r["losses"][-last:]) / last if len(r["losses"]) >= last else math.nan
        lines.append(
            f"| {r['label']} | {r['experts_backend']} | {len(r['losses'])} | {final:.4f} | {r['steady_step_ms']:.1f} | "
            f"{r['tokens_per_s']:.0f} | {r['mfu_989']:.1%} | {r['peak_mem_gib']:.1f} | {r['stopped']} |"
        )
    for e in result.get("errors", []):
        lines.append(f"\n{e}")
    if "rel_diff" in c:
        stand_in = any(r["label"].endswith("stand-in") for r in result["runs"])
        lines.append(
            f"\nfinal-loss relative difference (mean of the last {c['last']} of {c['steps']} steps): "
            f"{c['rel_diff']:+.3%}, {'pass' if c['pass'] else 'FAIL'} at {TOLERANCE:.0%} {c['why']}"
            + (" (against a stand-in: the plumbing only, nothing of FP8)" if stand_in else "")
        )
    else:
        lines.append(f"\nno comparison: {c.get('why', '')}")
    if "rel_diff" in result.get("control", {}):
        lines.append(f"bf16 against itself (the noise floor): {result['control']['rel_diff']:+.3%}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="configs/tiny.toml on the CPU, reference experts")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=4, help="rows per step")
    ap.add_argument("--seq", type=int, default=4096, help="tokens per row")
    ap.add_argument("--skip", type=int, default=10, help="first steps of each run left out of the timing")
    ap.add_argument("--last", type=int, default=20, help="steps whose mean loss is the final loss")
    ap.add_argument(
        "--warmup-steps", type=int, default=None, help="LR warmup in steps (default: 10%% of --steps; -1: the config's)"
    )
    ap.add_argument("--seed", type=int, default=0, help="of the initial weights")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--control", action="store_true", help="a third run: bf16 again (the noise floor)")
    ap.add_argument("--deadline-s", type=float, default=500.0, help="exit (with a traceback) after this")
    ap.add_argument("--out", default=os.environ.get("OUT", "."), help="directory of fp8_parity.json/.png")
    ap.add_argument("--plot", metavar="JSON", help="only draw the PNG of a written JSON (beside it)")
    args = ap.parse_args()
    if args.plot:
        plot(json.loads(Path(args.plot).read_text()), Path(args.plot).with_suffix(".png"))
        return
    t_start = time.perf_counter()
    # A kernel that never returns cannot be interrupted from Python: dump the stacks and exit at the deadline.
    # The loop stops by itself 30 s before (soft), so that the JSON of what ran is written.
    faulthandler.dump_traceback_later(args.deadline_s, exit=True)
    stop_at = t_start + args.deadline_s - 30
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    if args.smoke:  # eager: compiled, the reference experts recompile per expert (a loop over them)
        args.steps, args.batch, args.seq, args.last, args.skip = min(args.steps, 30), 2, 64, 5, 3
        args.no_compile = True
    cfg = load_config(ROOT / "configs" / ("tiny.toml" if args.smoke else "moonlet.toml"))
    mc = cfg.trainer.model
    warmup = args.steps // 10 if args.warmup_steps is None else args.warmup_steps
    optim = cfg.trainer.optim
    if warmup >= 0:
        optim = dataclasses.replace(optim, warmup_tokens=warmup * args.batch * args.seq)
    # The backends first: an FP8 backend that cannot run on the GPU ends the script before any work.
    errors: list[str] = []
    bf16 = "reference" if args.smoke else select_backend("grouped_mm", device, torch.bfloat16)
    plan = [Run("bf16", "bf16", bf16)]
    try:
        plan.append(Run("fp8", "fp8", select_backend("cutedsl", device, torch.bfloat16, precision="fp8")))
    except BackendUnavailable as exc:
        if not args.smoke:
            raise
        # The plumbing only: the second run is the reference again, labelled as such.
        errors.append(f"fp8 experts unavailable here ({exc}); the second run is the reference experts again")
        plan.append(Run("fp8-stand-in", "bf16", "reference"))
    if args.control:
        plan.append(Run("bf16-control", "bf16", bf16))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        rows, about = corpus_rows(args.steps * args.batch, args.seq, Path(tmp))
    rows = rows.to(device)
    print(f"corpus: {about['lines']} lines, e.g. {about['first_lines'][:2]}", flush=True)
    t0 = time.perf_counter()
    init_state = build_model(mc, "reference", seed=args.seed).state_dict()
    print(f"initial weights: {time.perf_counter() - t0:.1f} s", flush=True)
    result: dict = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "model": "tiny" if args.smoke else "moonlet",
        "args": vars(args),
        "warmup_tokens": optim.warmup_tokens,
        "corpus": about,
        "errors": errors,
        "runs": [],
    }

    def save() -> None:
        result["runs"] = [asdict(r) for r in plan if r.losses]
        if len(plan) > 1 and plan[1].losses:
            result["comparison"] = compare(plan[0], plan[1], args.last, args.steps)
        if len(plan) > 2 and plan[2].losses:
            result["control"] = compare(plan[0], plan[2], args.last, args.steps)
        (out / "fp8_parity.json").write_text(json.dumps(result, indent=2))

    for run in plan:
        print(f"== {run.label}: {run.precision} experts ({run.experts_backend})", flush=True)
        try:
            train(run, mc, optim, init_state, rows, args.batch, not args.no_compile, args.skip, stop_at, device)
        except Exception as exc:  # recorded with the steps it took; the other runs still run
            traceback.print_exc()
            run.stopped = f"error after {len(run.losses)} steps: {exc!r}"[:400]
        if device.type == "cuda":
            torch.cuda.empty_cache()  # here, once the failed run's frames (and its model) are gone
        save()
    if "comparison" not in result:
        result["comparison"] = {"pass": False, "why": "the second run took no step"}
        save()
    try:
        plot(result, out / "fp8_parity.png")
    except ImportError as exc:
        print(f"no PNG ({exc}): draw it here with python bench/fp8_parity.py --plot fp8_parity.json", flush=True)
    faulthandler.cancel_dump_traceback_later()
    print(f"total {time.perf_counter() - t_start:.0f} s")
    print(markdown(result))


if __name__ == "__main__":
    main()
