"""One launch of the grouped GEMM per named schedule (FP8 or bf16), for Nsight Compute to read its hardware counters
(warp stall reasons, pipe utilization) at the 128-expert shape of bench/cutedsl_check.py: the forward gate_up
GEMM, 131,072 rows, K = 2048, N = 1536, or for the FP8 weight-gradient schedules its weight gradient (the
k-grouped GEMM over each expert's 1,024 tokens, [1536, 2048] per expert, fp32 out), from operands quantized
beforehand. Each schedule is compiled and run once unprofiled, then launched once more, so that ncu's
`--launch-skip`/`--launch-count` can pick the second:

    ncu --clock-control none -k regex:GroupedGemm --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats python3 bench/cutedsl_ncu.py "<FP8_CONFIGS name>"

(bench/h200_cutedsl_fp8.sh runs it per schedule). Names are those of bench/cutedsl_check.py's FP8_CONFIGS,
FP8_WGRAD_CONFIGS and BF16_CONFIGS."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cutedsl_check import BF16_CONFIGS, FP8_CONFIGS, FP8_WGRAD_CONFIGS  # noqa: E402

from trainer.experts.cutedsl import grouped  # noqa: E402
from trainer.experts.cutedsl.quant import quantize_rows_kernel  # noqa: E402
from trainer.experts.fp8 import quantize_blocks, quantize_tokens_t  # noqa: E402


def main() -> None:
    names = sys.argv[1:]
    known = {**FP8_CONFIGS, **FP8_WGRAD_CONFIGS, **BF16_CONFIGS}
    unknown = [n for n in names if n not in known]
    if not names or unknown:
        raise SystemExit(f"name schedules of bench/cutedsl_check.py {sorted(known)}; got {unknown}")
    rows, H, N, E = 131072, 2048, 1536, 128
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, H, device="cuda", generator=g).bfloat16()
    w = (torch.randn(E, N, H, device="cuda", generator=g) * 0.02).bfloat16()
    offs = torch.full((E,), rows // E, device="cuda").cumsum(0).int()
    items = grouped.work_items(offs, rows, 128)
    qx, qw = quantize_rows_kernel(x), quantize_blocks(w)
    if any(n in FP8_WGRAD_CONFIGS for n in names):  # gate_up's weight gradient: grad_h [rows, N] and x, per expert
        grad_h = torch.randn(rows, N, device="cuda", generator=g).bfloat16()
        (ga, sa, ends), (gb, sb, _) = quantize_tokens_t(grad_h, offs), quantize_tokens_t(x, offs)
    for name in names:
        for _ in range(2):  # compile + run, then the launch ncu profiles
            if name in FP8_WGRAD_CONFIGS:
                grouped.k_grouped_scaled(ga, sa, gb, sb, ends, torch.float32, FP8_WGRAD_CONFIGS[name])
            elif name in FP8_CONFIGS:
                grouped.m_grouped_scaled(*qx, *qw, offs, items, FP8_CONFIGS[name])
            else:
                grouped.m_grouped(x, w.permute(1, 2, 0), offs, items, BF16_CONFIGS[name])
        torch.cuda.synchronize()
        print(f"launched {name}", flush=True)


if __name__ == "__main__":
    main()
