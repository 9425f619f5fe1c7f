"""The run's lineage: which published weight version holds the trainer's weights after which optimizer step.

Without faults version = step (optimizer step t produces version t+1). A version number names
one set of weights for the whole experiment and is never reused, so a trainer that resumes from a
checkpoint at step S, while the run it continues already used numbers beyond S's (published them,
died half-way through writing one, or left workers serving one), publishes S's weights under a new,
higher number: the lineage is then no longer the identity. It records every (step, version)
publication; the flow policy thinks in steps (staleness is a difference of steps), the generators
and the evaluator in versions, and the trainer translates with this. It is saved in checkpoints, so
a second resume extends the lineage of its checkpoint. Versions of the lost run (published after the
checkpoint, before the crash) are in no lineage: no sample with their tokens is ever trained.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class UnknownVersion(LookupError):
    """A weight version that this run's lineage never published (e.g. one of a run lost to a crash)."""


@dataclass
class Lineage:
    pairs: list[tuple[int, int]] = field(default_factory=list)
    """(step, version) for every publication in order; versions strictly rise, steps never fall."""
    floor: int = 0
    """The next version is at least this (not saved: set at start from the numbers the experiment used)."""

    def __post_init__(self) -> None:
        self._step_of = {v: s for s, v in self.pairs}
        for (s0, v0), (s1, v1) in zip(self.pairs, self.pairs[1:], strict=False):
            if v1 <= v0 or s1 < s0:
                raise ValueError(f"lineage pairs out of order: (step {s0}, v{v0}) then (step {s1}, v{v1})")

    @classmethod
    def from_state(cls, pairs: list[list[int]] | list[tuple[int, int]]) -> Lineage:
        return cls([(int(s), int(v)) for s, v in pairs])

    def state(self) -> list[list[int]]:
        return [[s, v] for s, v in self.pairs]

    def next_version(self) -> int:
        """The number the next publication takes: one above the last, and at least `floor`."""
        last = self.pairs[-1][1] + 1 if self.pairs else 0
        return max(last, self.floor)

    def record(self, step: int, version: int) -> None:
        if self.pairs and (version <= self.pairs[-1][1] or step < self.pairs[-1][0]):
            raise ValueError(f"publication (step {step}, v{version}) after {self.pairs[-1]} breaks the lineage")
        self.pairs.append((step, version))
        self._step_of[version] = step

    def __contains__(self, version: int) -> bool:
        return version in self._step_of

    def step_of(self, version: int) -> int:
        """The step whose weights `version` holds."""
        try:
            return self._step_of[version]
        except KeyError:
            raise UnknownVersion(
                f"weight version {version} is not in this run's lineage (published: "
                f"{self._describe()}); it belongs to a run lost to a crash, and its samples must not be trained"
            ) from None

    def version_of(self, step: int) -> int | None:
        """The newest version published with the weights of `step`, or None."""
        return next((v for s, v in reversed(self.pairs) if s == step), None)

    def versions_of(self, steps: set[int]) -> set[int]:
        """Every version published with the weights of one of `steps`."""
        return {v for s, v in self.pairs if s in steps}

    def _describe(self) -> str:
        shifted = [(s, v) for s, v in self.pairs if s != v]
        if not shifted:
            return f"versions 0..{self.pairs[-1][1]} = steps" if self.pairs else "none"
        return ", ".join(f"step {s} as v{v}" for s, v in self.pairs[-8:])
