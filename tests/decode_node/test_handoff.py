"""The decode worker's handoff table: every move checked against the transitions allowed,
ended handoffs gone from it, and the moves kept as a trace."""

from __future__ import annotations

import pytest

from tandem.decode_node.handoff import TRANSITIONS, DecodeHandoff, Handoff, handoff_table

S = DecodeHandoff


def test_the_ways_through_the_handoff():
    table = handoff_table()
    for rid in "abcd":
        table.begin(rid, Handoff())
    table.move("a", S.FIRST_TOKEN_SENT)  # streamed early, then its KV: it runs
    table.move("a", S.RUNNING)
    table.move("b", S.READY)  # KV first, then its token
    table.move("b", S.RUNNING)
    table.move("c", S.ENDED_BEFORE_KV)  # its token ended it: blocks wait for the transfer
    table.move("c", S.ABORTING)  # aborted while a writer held the blocks
    assert table.count(S.ABORTING) == 1 and table.count(S.RESERVED) == 1 and len(table) == 2
    table.move("c", S.FREED)
    table.move("d", S.FREED)  # aborted, fenced at once
    assert [table.get(rid) for rid in "abcd"] == [None] * 4
    assert [(rid, a.name, b.name) for rid, a, b in table.trace if rid == "c"] == [
        ("c", "RESERVED", "RESERVED"), ("c", "RESERVED", "ENDED_BEFORE_KV"),
        ("c", "ENDED_BEFORE_KV", "ABORTING"), ("c", "ABORTING", "FREED")]


def test_a_move_the_table_does_not_allow_is_refused():
    table = handoff_table()
    table.begin("r", Handoff())
    table.move("r", S.READY)
    with pytest.raises(AssertionError, match="READY -> ABORTING"):
        table.move("r", S.ABORTING)  # its KV is in: no writer is left to wait for
    handoff = table.get("r")
    assert handoff is not None and handoff.state is S.READY  # unchanged
    with pytest.raises(ValueError):
        table.begin("r", Handoff())


def test_every_state_is_reachable_and_every_way_ends():
    table = handoff_table()
    reachable, todo = {S.RESERVED}, [S.RESERVED]
    while todo:
        for nxt in TRANSITIONS[todo.pop()] - reachable:
            reachable.add(nxt)
            todo.append(nxt)
    assert reachable == set(S)
    assert table.terminal == {S.RUNNING, S.FREED}
    ends = set(table.terminal)
    while (more := {s for s in S if TRANSITIONS[s] & ends} - ends):
        ends |= more
    assert ends == set(S)  # no state that cannot end
