"""The dispatch plan: where every routed row goes and where its result comes back, computed from the
exchanged per-expert counts alone. Experts are owned in contiguous blocks (rank r owns experts
[r * E/W, (r + 1) * E/W)). A source's rows, already sorted by expert then token, are therefore one
contiguous segment per owner. In the owner's receive buffer the rows sit expert-major: for each local
expert, the rows of source 0, then source 1, ..., each in the source's token order, which is exactly
the order a single rank holding the concatenated batch would give them. So the owner's grouped GEMM
sees the same matrices as the single-rank run, and the offsets are prefix sums every rank can compute
from the same counts matrix: no negotiation, no atomics, bitwise reproducible."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DispatchPlan:
    """One MoE call's row movement, seen from one rank (host-side sizes, device-side indices)."""

    counts: torch.Tensor
    """[W, E] int64 on the host: rows that source s routes to global expert e."""
    rank: int
    world: int
    send_splits: list[int]
    """Rows this rank sends to each owner (consecutive segments of its expert-sorted rows)."""
    recv_splits: list[int]
    """Rows this rank receives from each source, as owner."""
    send_offsets: list[int]
    """Start of the segment for each owner in this rank's sorted rows."""
    recv_offsets: list[int]
    """Start of each source's rows in the source-major order of what this rank receives."""
    return_offsets: list[int]
    """For each source s: where the rows s sent to this rank start in s's sorted rows (the combine
    writes the results back there)."""
    recv_index: torch.Tensor
    """[rows_in] int64 (device): the expert-major position of each received row, sources in rank order."""
    put_index: list[torch.Tensor]
    """Per owner r: the expert-major position in r's buffer of each row this rank sends to r."""
    expert_offsets: torch.Tensor
    """[E/W] int32 (device): running end of each local expert's rows, the grouped-GEMM offsets."""
    rows_out: int
    """Rows this rank routes (its sorted rows; the combine returns this many)."""
    rows_in: int
    """Rows this rank's experts process."""
    max_rows: int
    """max over ranks of max(rows_in, rows_out): the size a symmetric buffer must have on every rank."""


def _positions(starts: torch.Tensor, sizes: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """cat(arange(starts[i], starts[i] + sizes[i]) for i), built on `device` from the small host tables
    starts, sizes [n] (int64): no Python loop, no host work per row, and no device-to-host sync (the output's
    length is known on the host and given to repeat_interleave)."""
    total = int(sizes.sum())
    starts, sizes = starts.to(device), sizes.to(device)
    seg_begin = torch.cumsum(sizes, 0) - sizes  # where each segment begins in the output
    within = torch.arange(total, device=device) - torch.repeat_interleave(seg_begin, sizes, output_size=total)
    return torch.repeat_interleave(starts, sizes, output_size=total) + within


def make_plan(counts: torch.Tensor, rank: int, device: torch.device | str) -> DispatchPlan:
    """The plan of `rank` from counts [W, E] (int, host): every rank computes the same global layout. The
    host works on [W, W, E/W] tables only; the per-row indices are built on `device`."""
    counts = counts.to("cpu", torch.int64)
    W, E = counts.shape
    if E % W:
        raise ValueError(f"{E} experts do not split over {W} ranks; pick an EP size that divides n_routed_experts")
    El = E // W
    cl = counts.view(W, W, El)  # [source, owner, local expert]
    per_pair = cl.sum(-1)  # [source, owner] rows
    totals = cl.sum(0)  # [owner, local expert] rows each expert processes
    expert_start = torch.cumsum(totals, 1) - totals  # [owner, El]
    source_start = torch.cumsum(cl, 0) - cl  # [source, owner, El]: rows of lower sources for that expert
    base = expert_start.unsqueeze(0) + source_start  # [source, owner, El]: where (s, r, j) rows start at r
    # What this rank sends, owner after owner, then cut per owner; what it receives, source after source.
    put_all = _positions(base[rank].reshape(-1), cl[rank].reshape(-1), device)
    put_index = list(put_all.split(per_pair[rank].tolist()))
    recv_index = _positions(base[:, rank].reshape(-1), cl[:, rank].reshape(-1), device)
    send = per_pair[rank].tolist()
    recv = per_pair[:, rank].tolist()
    rows_in = per_pair.sum(0)  # [owner]
    rows_out = per_pair.sum(1)  # [source]
    before_owner = torch.cumsum(per_pair, 1) - per_pair  # [source, owner]: start of the segment for owner
    return DispatchPlan(
        counts=counts,
        rank=rank,
        world=W,
        send_splits=send,
        recv_splits=recv,
        send_offsets=[sum(send[:r]) for r in range(W)],
        recv_offsets=[sum(recv[:s]) for s in range(W)],
        return_offsets=before_owner[:, rank].tolist(),
        recv_index=recv_index,
        put_index=put_index,
        expert_offsets=torch.cumsum(totals[rank], 0).to(device=device, dtype=torch.int32),
        rows_out=int(rows_out[rank]),
        rows_in=int(rows_in[rank]),
        max_rows=int(torch.maximum(rows_in, rows_out).max()),
    )
