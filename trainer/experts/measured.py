"""What `select_backend("auto", ...)` reads to choose between torch._grouped_mm and our CuTeDSL kernel in bf16: the
measured speed of the cutedsl expert SwiGLU (forward + backward) against grouped_mm's, per GPU and expert shape
(hidden H, expert intermediate I, experts E, top-k). A table shipped with the package, not a timing at start: a
first-call timing would make two ranks (or two runs) of one job choose differently by noise. Above 1.0 cutedsl
is faster and `auto` takes it; a GPU or shape not in the table keeps grouped_mm, and the log says so. Add rows
from bench/cutedsl_check.py (its "chosen" block) or bench/moe_bench.py, naming the bench/RESULTS.md section."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Measured:
    """cutedsl's speed over grouped_mm's (time of grouped_mm / time of cutedsl, forward + backward of the expert
    SwiGLU) and where it was measured."""

    speedup: float
    source: str


# (GPU family, H, I, E, top-k) -> measurement.
SPEEDUPS: dict[tuple[str, int, int, int, int], Measured] = {
    ("H200", 2048, 768, 128, 8): Measured(
        1 / 1.06, "bench/RESULTS.md 'CuTeDSL FP8 experts', 2026-12-04: compiled, 7.391 ms against 6.947 ms"
    ),
    ("H100", 2048, 768, 128, 8): Measured(
        8.205 / 7.720,
        "bench/RESULTS.md 'Weight gradients in the masters' dtype', 2026-12-07: the expert layer compiled over fp32 "
        "masters (training's case), our weight gradients written in fp32, 7.720 ms against 8.205 ms",
    ),
    ("H200", 1024, 512, 64, 6): Measured(
        1 / 1.03, "issue 36 (2026-12-04, TVM-FFI launches): the expert GEMMs fwd+bwd, 1.03x grouped_mm's time"
    ),
}


def gpu_family(name: str) -> str:
    """'NVIDIA H200' -> 'H200', 'NVIDIA H100 80GB HBM3' -> 'H100': the table's key for a device name."""
    words = name.replace("NVIDIA", "").split()
    return words[0] if words else name


def auto_bf16(gpu: str, shape: tuple[int, int, int, int] | None, cutedsl_reason: str | None) -> tuple[str, str]:
    """The bf16 backend `auto` takes on a CUDA GPU named `gpu` for expert `shape` (None: unknown), given why
    cutedsl cannot run there (None: it can): (grouped_mm or cutedsl, why, for the log)."""
    if cutedsl_reason is not None:
        return "grouped_mm", f"cutedsl cannot run: {cutedsl_reason}"
    if shape is None:
        return "grouped_mm", "the expert shape was not given"
    key = (gpu_family(gpu), *shape)
    found = SPEEDUPS.get(key)
    if found is None:
        return (
            "grouped_mm",
            f"cutedsl was not measured on {key[0]} at H{shape[0]} I{shape[1]} E{shape[2]} top-{shape[3]}",
        )
    verdict = "faster" if found.speedup > 1.0 else "not faster"
    name = "cutedsl" if found.speedup > 1.0 else "grouped_mm"
    return name, f"cutedsl measured {found.speedup:.2f}x grouped_mm's speed there ({verdict}; {found.source})"
