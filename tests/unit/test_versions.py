"""The run's lineage (common/weights/lineage.py): without faults version = step; after a resume the weights of
a step are published under a new, higher number, and versions of the lost run are no one's."""

from __future__ import annotations

import pytest

from common.weights.lineage import Lineage, UnknownVersion


def test_without_faults_every_step_publishes_its_own_number():
    lineage = Lineage()
    for step in range(4):
        version = lineage.next_version()
        lineage.record(step, version)
        assert version == step and lineage.step_of(version) == step


def test_a_resume_continues_numbering_above_the_lost_run_and_forgets_its_versions():
    # Checkpoint at step 5: steps 0..4 were published as v0..v4; the lost run then reached v7.
    lineage = Lineage.from_state([[s, s] for s in range(5)])
    lineage.floor = 8
    republished = lineage.next_version()
    lineage.record(4, republished)  # the generators serve step 4's weights again, as v8
    lineage.record(5, lineage.next_version())
    assert (republished, lineage.version_of(5)) == (8, 9)
    assert [lineage.step_of(v) for v in (3, 4, 8, 9)] == [3, 4, 4, 5]
    assert lineage.version_of(4) == 8 and lineage.versions_of({4}) == {4, 8}
    for lost in (5, 6, 7):
        assert lost not in lineage
        with pytest.raises(UnknownVersion, match=f"weight version {lost} is not in this run's lineage"):
            lineage.step_of(lost)
    # Saved and restored with a checkpoint, it is the same lineage.
    assert Lineage.from_state(lineage.state()).pairs == lineage.pairs


def test_a_publication_that_would_reuse_a_number_or_go_back_a_step_is_refused():
    lineage = Lineage.from_state([[0, 0], [1, 3]])
    with pytest.raises(ValueError, match="breaks the lineage"):
        lineage.record(2, 3)
    with pytest.raises(ValueError, match="breaks the lineage"):
        lineage.record(0, 4)
    with pytest.raises(ValueError, match="out of order"):
        Lineage.from_state([[0, 2], [1, 1]])
