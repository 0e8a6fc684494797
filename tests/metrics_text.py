"""Reading Prometheus text exposition in tests: with prometheus_client's parser (an
independent reader of the format) and, where installed, Prometheus' own promtool."""

from __future__ import annotations

import shutil
import subprocess

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse_samples(text: str) -> Samples:
    """Every sample of an exposition, by (sample name, labels); raises on malformed text."""
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in samples, f"duplicate series {key}"
            samples[key] = s.value
    return samples


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name` over every series whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def label_values(samples: Samples, name: str, label: str) -> set[str]:
    return {dict(ls)[label] for (n, ls) in samples if n == name and label in dict(ls)}


def promtool_check_metrics(text: str) -> str | None:
    """`promtool check metrics` on the text -> its complaints (None when promtool is absent).
    Raises when promtool finds the exposition invalid."""
    promtool = shutil.which("promtool")
    if promtool is None:
        return None
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    # Exit 1 with lint findings only is a warning; a parse error says "error while linting".
    assert "error while linting" not in result.stderr + result.stdout, result.stderr + result.stdout
    return (result.stdout + result.stderr).strip()
