"""Sequence packing (`trainer.pack`): samples laid end to end in rows of at most a token budget instead of one
right-padded row each, with what the model needs to keep them apart: per token its sample within the row
(`documents`, -1 for the padding at a row's end) and its position within its sample (RoPE restarts at 0).
Attention never crosses a sample's boundary (trainer.model.attention.DocumentMask), so every sample's
log-probs, losses and gradients are those it has alone in a padded row; only fewer padding positions are
computed.

Rows are filled first-fit in decreasing length order, then dealt to the data-parallel ranks by token count:
the core gives rank r the r-th contiguous share of the rows (trainer.core.rank_rows), so the rows are ordered
rank after rank, each row going, longest first, to the rank with the fewest tokens that still has room for a
row. Pure functions; the RL batch, the warm start and pretraining build their packed batches with them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from trainer.core import rank_rows

Batch = dict[str, torch.Tensor]


def pack_rows(lengths: Sequence[int], budget: int, world: int = 1) -> list[list[int]]:
    """The samples (indices into `lengths`) of each row: no row holds more than `budget` tokens, there are at
    least `world` rows when there are that many samples, and the rows come rank after rank (`rank_rows`'
    shares of `world` ranks) balanced by token count. Each row lists its samples in index order."""
    if any(n > budget for n in lengths):
        raise ValueError(
            f"a sample of {max(lengths)} tokens does not fit a packed row of {budget}; raise trainer.pack_tokens "
            "to at least the longest sample (0: the step's longest)"
        )
    rows: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fit = next((r for r, load in enumerate(loads) if load + lengths[i] <= budget), None)
        if fit is None:
            rows.append([i])
            loads.append(lengths[i])
        else:
            rows[fit].append(i)
            loads[fit] += lengths[i]
    # Every rank needs a row: split the fullest-in-samples rows until there are enough.
    while len(rows) < world and any(len(r) > 1 for r in rows):
        r = max(range(len(rows)), key=lambda r: len(rows[r]))
        moved = rows[r].pop()
        loads[r] -= lengths[moved]
        rows.append([moved])
        loads.append(lengths[moved])
    room = [s.stop - s.start for s in (rank_rows(len(rows), world, k) for k in range(world))]
    ranks: list[list[int]] = [[] for _ in range(world)]
    tokens = [0] * world
    for r in sorted(range(len(rows)), key=lambda r: -loads[r]):
        k = min((k for k in range(world) if len(ranks[k]) < room[k]), key=lambda k: tokens[k])
        ranks[k].append(r)
        tokens[k] += loads[r]
    return [sorted(rows[r]) for rank in ranks for r in rank]


def pack_tensors(samples: Sequence[Batch], rows: Sequence[Sequence[int]], fill: Mapping[str, float]) -> Batch:
    """Samples' per-token tensors (each sample a dict of [n_i, ...] tensors, n_i its tokens) laid into packed
    rows [R, L, ...] (L: the longest row), padding filled with `fill[name]` (0 when not named), beside
    "documents" [R, L] (the sample's index within its row, -1: padding) and "positions" [R, L] (0.. within
    each sample, 0 on padding)."""
    lengths = [len(next(iter(s.values()))) for s in samples]
    L = max(sum(lengths[i] for i in row) for row in rows)
    out = {k: torch.full((len(rows), L, *v.shape[1:]), fill.get(k, 0), dtype=v.dtype) for k, v in samples[0].items()}
    documents = torch.full((len(rows), L), -1, dtype=torch.long)
    positions = torch.zeros(len(rows), L, dtype=torch.long)
    for r, row in enumerate(rows):
        at = 0
        for d, i in enumerate(row):
            n = lengths[i]
            for k, v in samples[i].items():
                out[k][r, at : at + n] = v
            documents[r, at : at + n] = d
            positions[r, at : at + n] = torch.arange(n)
            at += n
    return {**out, "documents": documents, "positions": positions}


def pack_batch(
    batch: Batch, lengths: Sequence[int], parts: Sequence[slice], budget: int, world: int, fill: Mapping[str, float]
) -> tuple[Batch, list[slice]]:
    """A batch of one right-padded sample per row, packed: `lengths` [B] the samples' tokens (row b's first
    lengths[b] positions), `parts` the row slices that must stay apart (the PPO mini-batches, each an optimizer
    update whose rows the core splits over `world` ranks on their own). Per-token tensors [B, L, ...] keep their
    first lengths[b] tokens; per-row tensors [B] become per token (a sample's value on each of its tokens).
    Returns the packed batch and the row slices of `parts` in it."""
    L = batch["tokens"].shape[1]

    def sample(b: int) -> Batch:
        n = lengths[b]
        return {k: v[b, :n] if v.dim() >= 2 and v.shape[1] == L else v[b].expand(n) for k, v in batch.items()}

    packed: list[Batch] = []
    out_parts: list[slice] = []
    start = 0
    for part in parts:
        samples = [sample(b) for b in range(part.start, part.stop)]
        rows = pack_rows([lengths[b] for b in range(part.start, part.stop)], budget, world)
        packed.append(pack_tensors(samples, rows, fill))
        out_parts.append(slice(start, start + len(rows)))
        start += len(rows)
    width = max(p["tokens"].shape[1] for p in packed)
    out = {}
    for k in packed[0]:
        value = fill.get(k, -1 if k == "documents" else 0)
        out[k] = torch.cat([_pad_to(p[k], width, value) for p in packed])
    return out, out_parts


def _pad_to(t: torch.Tensor, width: int, value: float) -> torch.Tensor:
    """t [R, S, ...] right-padded along dim 1 to `width` with `value`."""
    if t.shape[1] == width:
        return t
    pad = torch.full((t.shape[0], width - t.shape[1], *t.shape[2:]), value, dtype=t.dtype)
    return torch.cat([t, pad], dim=1)


def stream_documents(tokens: torch.Tensor, eos: int) -> Batch:
    """Rows cut from a token stream of EOS-terminated documents (pretraining) as packed rows: {"documents",
    "positions"} [B, S], a document ending at each EOS. A row's first document may have begun in the row
    before: its positions start at 0 here, as its tokens see nothing of that row."""
    ends = (tokens == eos).long()
    documents = ends.cumsum(1) - ends  # EOS tokens before this one
    S = tokens.shape[1]
    index = torch.arange(S).expand_as(tokens)
    starts = torch.where(torch.nn.functional.pad(ends, (1, -1)) > 0, index, torch.zeros_like(index))
    return {"documents": documents, "positions": index - starts.cummax(1).values}


def documents_of(batch: Batch) -> torch.Tensor | None:
    """A batch's "documents" [B, S] when its rows are packed, None when each row is one sample."""
    return batch.get("documents")


def sample_count(batch: Batch) -> int:
    """Samples in a batch: one per row, or, packed, one per document of every row."""
    documents = documents_of(batch)
    if documents is None:
        return next(iter(batch.values())).shape[0]
    return int((documents.amax(dim=1) + 1).sum())


def padding_positions(lengths: Sequence[int], budget: int, world: int = 1) -> tuple[int, int]:
    """(positions the model computes packed, positions it computes padded) for samples of these lengths:
    rows x longest row, packed into rows of `budget`, against one row each of the longest sample."""
    rows = pack_rows(lengths, budget, world)
    longest_row = max(sum(lengths[i] for i in row) for row in rows)
    return len(rows) * longest_row, len(lengths) * max(lengths)
