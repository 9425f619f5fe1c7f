"""Reading a /metrics page as Prometheus does: prometheus_client's own text parser (which rejects a malformed
page) into sample values by name and labels."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """(sample name, its labels) -> value of every sample of an exposition page."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(text: str, name: str, **labels: str) -> float:
    """The one sample `name` with exactly `labels` (KeyError naming it when the page has none)."""
    return samples(text)[(name, frozenset(labels.items()))]


def total(text: str, name: str, **labels: str) -> float:
    """The sum of the samples `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples(text).items() if n == name and want <= ls)
