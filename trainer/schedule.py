"""The warmup-stable-decay (WSD) learning-rate schedule, counted in tokens rather than steps so that
changing the batch size or gradient accumulation does not change the schedule's shape. It also gives
the decay of the aux-loss-free bias update rate, which falls to zero over the same decay phase."""

from __future__ import annotations

from dataclasses import dataclass

from common.config import OptimConfig


@dataclass(frozen=True)
class WSD:
    warmup_tokens: int = 0
    decay_tokens: int = 0
    total_tokens: int = 0
    min_lr_ratio: float = 0.0

    @classmethod
    def from_config(cls, cfg: OptimConfig) -> WSD:
        if cfg.decay_tokens and cfg.total_tokens and cfg.warmup_tokens + cfg.decay_tokens > cfg.total_tokens:
            raise ValueError(
                f"trainer.optim: warmup_tokens ({cfg.warmup_tokens}) + decay_tokens ({cfg.decay_tokens}) exceed "
                f"total_tokens ({cfg.total_tokens}); shorten the phases or raise total_tokens"
            )
        return cls(cfg.warmup_tokens, cfg.decay_tokens, cfg.total_tokens, cfg.min_lr_ratio)

    def decay_progress(self, tokens: int) -> float:
        """0 before the decay phase, rising linearly to 1 at total_tokens."""
        if not (self.decay_tokens and self.total_tokens):
            return 0.0
        start = self.total_tokens - self.decay_tokens
        return min(1.0, max(0.0, (tokens - start) / self.decay_tokens))

    def lr_factor(self, tokens: int) -> float:
        """Multiplier of the peak learning rate once `tokens` tokens (this step's included) were trained on."""
        if self.warmup_tokens and tokens < self.warmup_tokens:
            return max(tokens, 0) / self.warmup_tokens
        return 1.0 - self.decay_progress(tokens) * (1.0 - self.min_lr_ratio)
