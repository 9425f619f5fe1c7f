"""What each decoder block keeps for its backward, tensor by tensor, on this device, beside the planner's figure.

trainer/plan.py measures the activations of one dense and one MoE block on the CPU and scales them; this census
says where a device's own figure differs from it. For each block of the config's shape (the MoE block with its
real expert count) at rows x seq tokens, activation checkpointing off:

- measured: the bytes the forward leaves allocated (CUDA: `memory_allocated` after minus before; CPU: the
  profiler's net of allocations and frees), the block's output included;
- census: autograd's saved tensors found by walking the graph from the output (each storage once; parameters,
  the input and the experts' persistent weight copy left out), grouped by the backward node that holds them;
- planned: `trainer.plan.block_bytes` at the same token count.

    python bench/act_census.py --device cuda --shapes 1x4096,2x4096          # one GPU
    python bench/act_census.py --device cpu --shapes 1x256 --experts 12      # here
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.config import ModelConfig, load_config  # noqa: E402
from trainer.model.moe import MoE  # noqa: E402
from trainer.model.recompute import run_block  # noqa: E402
from trainer.plan import block_bytes, head_bytes, probe_model  # noqa: E402


def saved_tensors(out: torch.Tensor, skip: set[int]) -> dict[tuple[str, str, tuple[int, ...]], int]:
    """Bytes of the storages autograd saved for out's backward, by (node, dtype, shape); storages in `skip` (by
    data pointer) and repeats are left out."""
    found: dict[tuple[str, str, tuple[int, ...]], int] = defaultdict(int)
    seen = set(skip)
    stack, visited = [out.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in visited:
            continue
        visited.add(node)
        tensors: list[torch.Tensor] = []
        for attr in dir(node):
            if attr.startswith("_saved_"):
                try:
                    value = getattr(node, attr)
                except RuntimeError:  # a saved tensor already freed
                    continue
                tensors += [v for v in (value if isinstance(value, tuple | list) else (value,)) if torch.is_tensor(v)]
        if hasattr(node, "saved_tensors"):  # custom autograd Functions
            try:
                tensors += [t for t in node.saved_tensors if torch.is_tensor(t)]
            except RuntimeError:
                pass
        for t in tensors:
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen or ptr == 0:
                continue
            seen.add(ptr)
            found[(node.name(), str(t.dtype).removeprefix("torch."), tuple(t.shape))] += t.untyped_storage().nbytes()
        stack += [n for n, _ in node.next_functions]
    return found


def kept_bytes(fn, device: torch.device) -> tuple[int, torch.Tensor]:  # type: ignore[no-untyped-def]
    """(bytes fn's forward leaves allocated, its output)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = fn()
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() - before, out
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = fn()
    return sum(e.self_cpu_memory_usage for e in prof.events()), out


def head(mc: ModelConfig, tokens: int, device: torch.device) -> int:
    """Bytes per micro-batch the head keeps (final norm, lm_head, the loss over logits.float(), as trainer/core.py)."""
    norm = torch.nn.RMSNorm(mc.hidden_size, device=device)
    lm_head = torch.nn.Linear(mc.hidden_size, mc.vocab_size, bias=False, device=device)
    x = torch.randn(tokens, mc.hidden_size, device=device, requires_grad=True)
    targets = torch.randint(0, mc.vocab_size, (tokens,), device=device)

    def fwd() -> torch.Tensor:
        return torch.nn.functional.cross_entropy(lm_head(norm(x)).float(), targets, reduction="sum")

    kept, _ = kept_bytes(fwd, device)
    return kept


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/moonlet.toml")
    p.add_argument("--device", default="cuda")
    p.add_argument("--shapes", default="1x4096,2x4096", help="rows x seq per forward, comma-separated")
    p.add_argument("--experts", type=int, default=0, help="routed experts of the MoE block (0: the config's)")
    p.add_argument("--backend", default="", help="experts backend (default: grouped_mm on CUDA, reference on CPU)")
    p.add_argument("--top", type=int, default=14, help="census rows printed per block")
    p.add_argument("--compile", action="store_true", help="also measure torch.compile'd blocks (the trainer's)")
    args = p.parse_args()
    device = torch.device(args.device)
    mc: ModelConfig = load_config(args.config).trainer.model
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    seq_max = max(s for _, s in shapes)
    experts = args.experts or mc.n_routed_experts
    backend = args.backend or ("grouped_mm" if device.type == "cuda" else "reference")
    model = probe_model(mc, experts, backend, max(mc.max_seq_len, seq_max), device)
    skip = {q.untyped_storage().data_ptr() for q in model.parameters()}
    for blk in model.model.layers:
        if isinstance(blk.mlp, MoE) and backend != "reference":
            skip |= {c.untyped_storage().data_ptr() for c in blk.mlp.experts.weight_copy(torch.bfloat16)}
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"torch {torch.__version__}, {name}; {args.config}, MoE block with {experts} experts, backend {backend}\n")
    print("| block | rows x seq | measured KB/token | census KB/token | planned KB/token | measured/planned |")
    print("|---|---|---:|---:|---:|---:|")
    detail = []
    compiled = {id(blk): torch.compile(blk) for blk in model.model.layers} if args.compile else {}
    for b, s in shapes:
        t = b * s
        angles = model.rope_angles[:s].unsqueeze(0)
        cos, sin = angles.cos() * model.rope_scale, angles.sin() * model.rope_scale
        planned = block_bytes(replace(mc, n_routed_experts=experts), "none", t, torch.bfloat16, s)
        for i, blk in enumerate(model.model.layers):
            kind = "dense" if i == 0 else "MoE"
            for variant in ("eager", "compiled") if args.compile else ("eager",):
                fn = compiled[id(blk)] if variant == "compiled" else blk
                x = torch.randn(b, s, mc.hidden_size, device=device, requires_grad=True)
                if variant == "compiled":  # compile outside the measurement
                    kept_bytes(lambda fn=fn, x=x, cos=cos, sin=sin: run_block(fn, "none", x, cos, sin), device)
                kept, out = kept_bytes(lambda fn=fn, x=x, cos=cos, sin=sin: run_block(fn, "none", x, cos, sin), device)
                census = saved_tensors(out, skip | {x.untyped_storage().data_ptr()})
                print(
                    f"| {kind} {variant} | {b} x {s} | {kept / t / 1e3:.1f} | {sum(census.values()) / t / 1e3:.1f} "
                    f"| {planned[i] / t / 1e3:.1f} | {kept / planned[i]:.2f} |",
                    flush=True,
                )
                rows = sorted(census.items(), key=lambda kv: -kv[1])[: args.top]
                out_kb = out.numel() * out.element_size() / t / 1e3
                detail.append(f"\n{kind} block {variant}, {b} x {s}: output {out_kb:.1f} KB/token")
                detail += [f"  {v / t:9.1f} B/token  {node} {dtype} {list(shape)}" for (node, dtype, shape), v in rows]
                del out, census, x
        measured, planned_head = head(mc, t, device), head_bytes(mc, t)
        print(
            f"| head | {b} x {s} | {measured / t / 1e3:.1f} | | {planned_head / t / 1e3:.1f} | {measured / planned_head:.2f} |"
        )
    print("\n".join(detail))


if __name__ == "__main__":
    main()
