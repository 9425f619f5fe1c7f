"""Log-probabilities under the distribution a sample was drawn from: the logits in float32 divided by the
row's temperature, truncated to its top-k and then its top-p (nucleus) set, renormalised. vLLM returns
exactly these as the behaviour log-probs (its workers run `--logprobs-mode processed_logprobs`), so the
trainer's proximal and current log-probs must be taken the same way, or every importance weight and PPO
ratio of a tempered or truncated run is biased.

The truncation set is a constant of the graph (as it is to the sampler); the gradient flows through the
kept logits. Rows sampled at temperature 1 over the full vocabulary take the plain log-softmax, bitwise the
numbers of `logprobs_of`; only truncated rows pay a sort over the vocabulary."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class RowSampling:
    """The sampling parameters of each row of a batch, as vLLM applied them: temperature [B] (> 0),
    top_k [B] (int; <= 0 or >= vocab: off, as vLLM's 0 and -1) and top_p [B] (in (0, 1]; 1: off)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor

    def __post_init__(self) -> None:
        if not (self.temperature.shape == self.top_k.shape == self.top_p.shape) or self.temperature.dim() != 1:
            raise ValueError(
                f"temperature {tuple(self.temperature.shape)}, top_k {tuple(self.top_k.shape)} and top_p "
                f"{tuple(self.top_p.shape)} must be one value per row ([B] each)"
            )


def logprobs_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-position log-probabilities of targets (float32); positions whose target is < 0 give 0."""
    flat = logits.reshape(-1, logits.shape[-1]).float()
    tgt = targets.reshape(-1)
    lp = -F.cross_entropy(flat, tgt.clamp(min=0), reduction="none")
    return torch.where(tgt >= 0, lp, torch.zeros_like(lp)).view(targets.shape)


# Positions whose vocabulary is sorted at once when finding kept sets: bounds the sort's values and indices
# (12 bytes a logit) to about 400 MB at any vocabulary size.
SORT_CHUNK_LOGITS = 1 << 25


@torch.no_grad()
def kept_tokens(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The tokens a sampler keeps: scaled [N, V] (float32 logits already divided by the temperature), top_k [N],
    top_p [N] -> bool [N, V]. Top-k keeps the logits >= the k-th largest (ties all kept); top-p then, on the
    top-k renormalised distribution in ascending order, drops every token whose cumulative probability is
    <= 1 - p, never the most likely one. Sorted SORT_CHUNK_LOGITS logits at a time."""
    N, V = scaled.shape
    keep = torch.empty_like(scaled, dtype=torch.bool)
    k_all = torch.where((top_k <= 0) | (top_k >= V), V, top_k).long()
    step = max(1, SORT_CHUNK_LOGITS // V)
    for lo in range(0, N, step):
        rows = slice(lo, min(lo + step, N))
        ascending, order = scaled[rows].sort(dim=-1)
        # The k-th largest is at ascending index V - k; k = V keeps every token.
        kth = ascending.gather(-1, (V - k_all[rows]).unsqueeze(1))
        ascending = ascending.masked_fill(ascending < kth, float("-inf"))
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - top_p[rows].float()).unsqueeze(1)
        drop[:, -1] = False
        ascending = ascending.masked_fill(drop, float("-inf"))
        keep[rows] = torch.zeros_like(drop).scatter_(-1, order, ascending > float("-inf"))
    return keep


def sampled_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, sampling: RowSampling
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, S, V], targets [B, S] (< 0: not a target, gives 0) -> (float32 [B, S] log-probs of the
    targets under each row's sampling distribution, bool [B, S] the targets outside the trainer's own kept
    set). Such a target (the sampler kept it at a numerical boundary the trainer's logits fall the other side
    of) is added to its position's kept set instead of giving -inf; the caller counts them."""
    B, S, V = logits.shape
    T, top_k, top_p = sampling.temperature, sampling.top_k, sampling.top_p
    truncated = ((top_k > 0) & (top_k < V)) | (top_p < 1)
    tempered = (T != 1) & ~truncated
    outside = torch.zeros(B, S, dtype=torch.bool, device=logits.device)
    if not bool((truncated | tempered).any()):
        return logprobs_of(logits, targets), outside
    out = torch.zeros(B, S, dtype=torch.float32, device=logits.device)
    plain = ~(truncated | tempered)
    if bool(plain.any()):
        out[plain] = logprobs_of(logits[plain], targets[plain])
    if bool(tempered.any()):
        scaled = logits[tempered].float() / T[tempered].float().view(-1, 1, 1)
        out[tempered] = logprobs_of(scaled, targets[tempered])
    if bool(truncated.any()):
        rows = truncated.nonzero().squeeze(1)
        scaled = logits[rows].float() / T[rows].float().view(-1, 1, 1)
        tgt = targets[rows]
        b = len(rows)
        keep = kept_tokens(
            scaled.reshape(b * S, V), top_k[rows].repeat_interleave(S), top_p[rows].repeat_interleave(S)
        ).view(b, S, V)
        index = tgt.clamp(min=0).unsqueeze(-1)
        missing = ~keep.gather(-1, index).squeeze(-1) & (tgt >= 0)
        keep.scatter_(-1, index, True)
        out[rows] = logprobs_of(scaled.masked_fill(~keep, float("-inf")), tgt)
        outside[rows] = missing
    return out, outside


__all__ = ["RowSampling", "logprobs_of", "kept_tokens", "sampled_logprobs"]
