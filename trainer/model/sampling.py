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
    """The sampling parameters of a batch, as vLLM applied them, one per row ([B]: a row is one sample) or one
    per token ([B, S]: packed rows hold several samples): temperature (> 0), top_k (int; <= 0 or >= vocab: off,
    as vLLM's 0 and -1) and top_p (in (0, 1]; 1: off)."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor

    def __post_init__(self) -> None:
        if not (self.temperature.shape == self.top_k.shape == self.top_p.shape) or self.temperature.dim() not in (1, 2):
            raise ValueError(
                f"temperature {tuple(self.temperature.shape)}, top_k {tuple(self.top_k.shape)} and top_p "
                f"{tuple(self.top_p.shape)} must be one value per row ([B] each) or per token ([B, S] each)"
            )

    def per_token(self, S: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(temperature, top_k, top_p), each [B * S]: every position's parameters."""
        if self.temperature.dim() == 2:
            return self.temperature.reshape(-1), self.top_k.reshape(-1), self.top_p.reshape(-1)
        return tuple(t.repeat_interleave(S) for t in (self.temperature, self.top_k, self.top_p))  # type: ignore[return-value]


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
    targets under each position's sampling distribution, bool [B, S] the targets outside the trainer's own
    kept set). Such a target (the sampler kept it at a numerical boundary the trainer's logits fall the other
    side of) is added to its position's kept set instead of giving -inf; the caller counts them."""
    B, S, V = logits.shape
    T, top_k, top_p = sampling.per_token(S)
    flat, tgt = logits.reshape(B * S, V), targets.reshape(B * S)
    truncated = ((top_k > 0) & (top_k < V)) | (top_p < 1)
    tempered = (T != 1) & ~truncated
    outside = torch.zeros(B * S, dtype=torch.bool, device=logits.device)
    if not bool((truncated | tempered).any()):
        return logprobs_of(logits, targets), outside.view(B, S)
    out = torch.zeros(B * S, dtype=torch.float32, device=logits.device)
    plain = ~(truncated | tempered)
    if bool(plain.any()):
        out[plain] = logprobs_of(flat[plain], tgt[plain])
    if bool(tempered.any()):
        out[tempered] = logprobs_of(flat[tempered].float() / T[tempered].float().unsqueeze(1), tgt[tempered])
    if bool(truncated.any()):
        scaled = flat[truncated].float() / T[truncated].float().unsqueeze(1)
        kept_targets = tgt[truncated]
        keep = kept_tokens(scaled, top_k[truncated], top_p[truncated])
        index = kept_targets.clamp(min=0).unsqueeze(-1)
        outside[truncated] = ~keep.gather(-1, index).squeeze(-1) & (kept_targets >= 0)
        keep.scatter_(-1, index, True)
        out[truncated] = logprobs_of(scaled.masked_fill(~keep, float("-inf")), kept_targets)
    return out.view(B, S), outside.view(B, S)


__all__ = ["RowSampling", "logprobs_of", "kept_tokens", "sampled_logprobs"]
