"""The handoff as the workers lived it: every move their handoff tables recorded during the
cluster tests before this one (this file runs last of tests/cluster; conftest.py reads the
traces after each module, before a fault test can restart a worker) replayed through the
checked specification's per-side tables (kvtransfer/handoff_spec/tables.py), which the model
checker's own traces also follow: each request's recorded states must be a path of them."""

from __future__ import annotations

import collections
import logging

import pytest
from fault_calls import read_handoff_traces

from tandem.kvtransfer.handoff_spec.tables import DECODE, PREFILL, REAL_DECODE, REAL_PREFILL, is_path

pytestmark = pytest.mark.slow
logger = logging.getLogger(__name__)


def lives(trace: list[tuple[str, str, str]]) -> list[tuple[str, list[str]]]:
    """-> each request's states on one worker, in order: a request (re)enters its table as
    (id, initial, initial), so an id reused after its end starts a new life."""
    open_lives: dict[str, list[str]] = {}
    ended = []
    for request_id, before, after in trace:
        if before == after:  # entering
            if request_id in open_lives:
                ended.append((request_id, open_lives.pop(request_id)))
            open_lives[request_id] = [after]
        elif request_id in open_lives:  # (its entry may have left the bounded trace)
            open_lives[request_id].append(after)
    return ended + list(open_lives.items())


def test_every_recorded_handoff_is_a_path_of_the_specification(clusters, handoff_traces):
    read_handoff_traces(clusters["disaggregated"], handoff_traces)
    tables = {PREFILL: REAL_PREFILL, DECODE: REAL_DECODE}
    seen: dict[str, collections.Counter[str]] = {PREFILL: collections.Counter(), DECODE: collections.Counter()}
    num_lives: collections.Counter[str] = collections.Counter()
    for (side, instance, pid), trace in handoff_traces.items():
        for request_id, states in lives(trace):
            path = [tables[side][s] for s in states]
            verdict = is_path(side, path)
            assert verdict, f"{instance} (pid {pid}): {request_id}: {path}: {verdict.reason}"
            seen[side].update(path)
            num_lives[side] += 1
    logger.info("handoff lives replayed: %s; states seen: %s", dict(num_lives), {k: dict(v) for k, v in seen.items()})
    # Both sides saw many requests, at least along the usual way (the fault tests add their exits).
    assert num_lives[PREFILL] >= 30 and num_lives[DECODE] >= 30, num_lives
    assert {"prefilling", "sending", "sent", "freed"} <= set(seen[PREFILL]), seen[PREFILL]
    assert {"reserved", "first_token_sent", "ready", "running"} <= set(seen[DECODE]), seen[DECODE]
