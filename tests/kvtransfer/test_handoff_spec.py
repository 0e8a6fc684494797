"""The KV handoff's executable specification (kvtransfer/handoff_spec/): the model of the
real protocol keeps every property over every interleaving of two requests, two layers and
one fault; each deliberately wrong variant yields a counterexample whose trace replays
through the model; the model's per-request states are paths of the two sides' tables, and
so are the workers' own tables (decode_node/handoff.py, prefill_node/handoff.py)."""

from __future__ import annotations

import dataclasses
import importlib
import random

import pytest

from tandem.kvtransfer.handoff_spec import SHM, ZMQ, Config, HandoffModel, explore, is_path
from tandem.kvtransfer.handoff_spec.checker import AT_REST, SAFETY, STUCK, Report
from tandem.kvtransfer.handoff_spec.properties import decode_local, prefill_local
from tandem.kvtransfer.handoff_spec.tables import (
    DECODE,
    DECODE_TABLE,
    PREFILL,
    PREFILL_TABLE,
    REAL_DECODE,
    REAL_PREFILL,
    is_move,
)

MAIN = Config()
"""Two requests over one decode block (so it is reused), two layers, one fault, in place."""
CAP = 1_000_000
"""No shape here comes near it: a model change that made a space infinite fails, not hangs."""


def _changes(cfg: Config) -> str:
    """The fields of `cfg` that differ from the main shape, as a test id."""
    return ",".join(f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
                    if getattr(cfg, f.name) != getattr(MAIN, f.name))


@pytest.fixture(scope="module")
def main_report() -> Report:
    return explore(HandoffModel(MAIN))


def test_the_protocol_keeps_every_property_over_every_interleaving(main_report):
    assert MAIN.path == SHM and MAIN.blocks < MAIN.requests and MAIN.faults == 1
    assert main_report.ok, main_report.format(HandoffModel(MAIN))
    assert main_report.num_states >= 100_000
    assert main_report.seconds < 60


@pytest.mark.parametrize("cfg", [
    Config(path=ZMQ, layers=1),  # frames: the receiver writes, the prefill pool is read while queued
    Config(requests=1, cancels=1),  # a client's cancel at any moment, with a fault
    Config(requests=1, cancels=1, path=ZMQ),
    Config(layers=1, cancels=1, faults=0),  # both requests cancelled, any order
    Config(requests=3, layers=1, faults=0),
    Config(requests=1, chunks=2, layers=1, prefill_preemption=True),  # in place: no frame reads the blocks
    Config(requests=1, blocks=2, first_token_may_finish=False),
], ids=lambda cfg: _changes(cfg))
def test_other_shapes_keep_them_too(cfg):
    report = explore(HandoffModel(cfg), max_states=CAP)
    assert report.ok, report.format(HandoffModel(cfg))


BUGS = [
    (Config(free_before_revoke=True), SAFETY, "write_after_free"),
    (Config(free_before_revoke=True, path=ZMQ), SAFETY, "write_after_free"),
    (Config(free_while_revoking=True), SAFETY, "write_after_free"),
    (Config(no_epoch_check=True), SAFETY, "write_to_other"),
    (Config(prefill_preemption=True, chunks=2, layers=1, path=ZMQ), SAFETY, "source_read_after_free"),
    (Config(no_receiver_deadline=True), AT_REST, "no_leak"),
]


@pytest.mark.parametrize("cfg, kind, name", BUGS, ids=[_changes(cfg) for cfg, _, _ in BUGS])
def test_each_planted_bug_yields_a_counterexample_that_replays(cfg, kind, name):
    model = HandoffModel(cfg)
    report = explore(model, max_states=CAP)
    v = report.violation
    assert v is not None and (v.kind, v.name) == (kind, name), report.format(model)
    # The trace is a path of the model from its initial state...
    assert v.trace[0].label == "initial" and v.trace[0].state == model.initial()
    for before, step in zip(v.trace, v.trace[1:]):
        assert (step.label, step.state) in model.successors(before.state), step.label
    # ...and ends in the violation it reports.
    last = v.trace[-1].state
    if kind == SAFETY:
        violated = model.invariant(last)
        assert violated is not None and violated[0] == name
        assert all(model.invariant(step.state) is None for step in v.trace[:-1])
    else:
        assert all(model.is_fault(label) for label, _ in model.successors(last))
        unsettled = model.at_rest(last)
        assert unsettled is not None and unsettled[0] == name and not model.is_end(last)
    assert "VIOLATION" in report.format(model) and v.trace[-1].label in report.format(model)


def test_without_the_bug_the_same_shape_is_safe():
    # (The planted bugs' shapes, minus the bug, small enough to run each.)
    cfg = Config(chunks=2, layers=1, path=ZMQ, requests=1)
    assert explore(HandoffModel(cfg), max_states=CAP).ok
    assert explore(HandoffModel(dataclasses.replace(cfg, prefill_preemption=True))).violation is not None


def test_liveness_finds_a_state_that_cannot_end():
    """The checker's reverse pass: a cycle that never reaches an end is stuck."""
    class Loop:
        def initial(self):
            return 0

        def successors(self, s):
            return {0: [("go", 1), ("finish", 3)], 1: [("spin", 2)], 2: [("spin back", 1)], 3: []}[s]

        def invariant(self, s):
            return None

        def step_invariant(self, a, label, b):
            return None

        def is_fault(self, label):
            return False

        def at_rest(self, s):
            return None

        def is_end(self, s):
            return s == 3

        def describe(self, s):
            return str(s)

    report = explore(Loop())
    assert report.violation is not None and report.violation.kind == STUCK
    assert [step.state for step in report.violation.trace] == [0, 1]
    assert "2 reachable states" in report.violation.message


def _projected_moves(cfg: Config) -> set[tuple[str, str | None, str | None]]:
    """Every (side, before, after) that some step of the model makes to some request's
    local state, over every reachable state (its own breadth-first walk)."""
    model = HandoffModel(cfg)
    seen, frontier, moves = {model.initial()}, [model.initial()], set()
    while frontier:
        s = frontier.pop()
        for _, t in model.successors(s):
            for a, b in zip(s[1], t[1]):
                moves.add((DECODE, decode_local(a), decode_local(b)))
                moves.add((PREFILL, prefill_local(a, cfg.messages), prefill_local(b, cfg.messages)))
            if t not in seen:
                seen.add(t)
                frontier.append(t)
    return moves


def test_every_local_path_of_the_model_is_a_path_of_its_side_table():
    moves = set()
    for cfg in (Config(requests=1, cancels=1), Config(requests=1, cancels=1, path=ZMQ, layers=1)):
        moves |= _projected_moves(cfg)
    assert all(is_move(side, a, b) for side, a, b in moves), sorted(
        m for m in moves if not is_move(*m))
    reached = {b for side, _, b in moves if side == DECODE} | {b for side, _, b in moves if side == PREFILL}
    # Every state is reached but the one for n > 1 and beams, which the model leaves out.
    assert set(DECODE_TABLE) - reached == {"first_token_held"}
    assert set(PREFILL_TABLE) <= reached


def test_random_runs_of_the_model_record_paths_of_the_tables():
    model, rng = HandoffModel(Config(cancels=1)), random.Random(7)
    for _ in range(200):
        s = model.initial()
        paths: dict[tuple[str, int], list[str]] = {}
        while successors := model.successors(s):
            _, t = rng.choice(successors)
            for r, q in enumerate(t[1]):
                for side, local in ((DECODE, decode_local(q)), (PREFILL, prefill_local(q, MAIN.messages))):
                    path = paths.setdefault((side, r), [])
                    if local is not None and (not path or path[-1] != local):
                        path.append(local)
            s = t
            if model.is_end(s):
                break
        for (side, _), path in paths.items():
            if path:  # (a request never reserved, or never admitted, has none)
                assert is_path(side, path), (side, path, is_path(side, path).reason)


def test_is_path_says_why_a_path_is_not_one():
    assert is_path(DECODE, ["reserved", "receiving", "ready", "running", "freed"])
    assert is_path(PREFILL, ["prefilling", "sending", "sent", "freed"])
    assert is_path(DECODE, ["reserved", "first_token_sent"])  # still under way
    assert "starts at" in is_path(DECODE, ["ready", "running"]).reason
    assert "not allowed" in is_path(DECODE, ["reserved", "ready", "aborting"]).reason
    assert "not allowed" in is_path(PREFILL, ["prefilling", "freed", "sending"]).reason
    assert "no decode state" in is_path(DECODE, ["reserved", "lost"]).reason
    assert not is_path("router", ["new"]) and not is_path(DECODE, [])


@pytest.mark.parametrize("side, module, names", [(DECODE, "tandem.decode_node.handoff", REAL_DECODE),
                                                 (PREFILL, "tandem.prefill_node.handoff", REAL_PREFILL)])
def test_the_workers_own_tables_allow_only_moves_of_the_spec(side, module, names):
    real = importlib.import_module(module).TRANSITIONS
    assert {state.name for state in real} == set(names)
    for state, nexts in real.items():
        for after in nexts:
            assert is_move(side, names[state.name], names[after.name]), (state.name, after.name)
