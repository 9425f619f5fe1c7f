"""What a weight transport is: how the tensors of one version reach the workers. `WeightPublisher`
(publisher.py) owns everything around it (the version number, the live workers, `weights:current`,
`weights:log` and the event); a transport does, for one publish, `prepare` (check the tensors, start getting
them ready; nothing visible changes if this fails), `send` (bring the version onto the given workers and say
how each took it; a worker that failed is evicted), then `finish` (after the publish: drop what is no longer
needed, or, when the publish failed, what `prepare` and `send` left). One module per transport (file.py,
nccl.py); factory.py picks one by `rollout.weight_backend`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from common.weights.workers import WorkerOutcome

if TYPE_CHECKING:
    import torch

    from common.weights.writer import PeerWriters


class PublishError(RuntimeError):
    """A version could not be published (bad version number or tensors); nothing was changed."""


@dataclass
class PublishResult:
    """What a publish did: where the version lives, how long each part took, who acknowledged it."""

    version: int
    location: str
    bytes: int
    export_s: float
    write_s: float
    drive_s: float
    """From the start of the write to the last worker's acknowledgement (the write overlaps it when streamed)."""
    total_s: float
    shards: int = 1
    streamed: bool = False
    """Workers loaded each shard as it was written (rollout.stream_weights) instead of after the whole version."""
    workers: list[WorkerOutcome] = field(default_factory=list)
    source: int | None = None
    """For a republish: the version whose files these are."""
    delta_base: int | None = None
    """For a version written as a delta (rollout.weight_delta): the version it is a delta of."""

    @property
    def evicted(self) -> list[WorkerOutcome]:
        return [w for w in self.workers if not w.ok]

    @property
    def max_pause_s(self) -> float:
        return max((w.pause_window_s for w in self.workers if w.ok), default=0.0)

    @property
    def max_load_s(self) -> float:
        return max((w.load_s for w in self.workers if w.ok), default=0.0)


class WeightTransport(ABC):
    """How one version's tensors reach the workers; one publish at a time: prepare, send, finish."""

    backend: ClassVar[str]
    """The `rollout.weight_backend` this implements, as `weights:log` records it."""

    @abstractmethod
    async def prepare(
        self, version: int, tensors: Mapping[str, torch.Tensor], peers: PeerWriters | None = None
    ) -> None:
        """Get ready to send `tensors` (this rank's) as `version`; `peers` are the other trainer ranks, when they
        hold parts of it. PublishError, with nothing changed, when they cannot be sent."""

    async def prepare_copy(self, version: int, source: int) -> None:
        """Get ready to send the weights of the published version `source` again, as `version`."""
        raise PublishError(
            f"republish({version}): the {self.backend} transport keeps no published versions to send again; "
            f"publish the tensors of version {source} instead"
        )

    @abstractmethod
    async def send(self, version: int, workers: Mapping[str, str], pause_mode: str) -> PublishResult:
        """Bring the prepared version onto `workers` (worker_id -> URL), recording each one's new version in the
        pool hash and evicting the ones that failed; what was done. PublishError if the version itself could
        not be sent (then no worker serves it whole)."""

    @abstractmethod
    async def finish(self, published: bool) -> None:
        """After the publish: when `published` (weights:current is the version), drop what workers no longer
        need; otherwise remove what `prepare` and `send` left of the version."""
