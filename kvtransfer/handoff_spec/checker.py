"""An explicit-state model checker: every interleaving of a model's actions, breadth first.

Generic over the model (the handoff's is model.py): states are hashable values, a model
gives the initial state and each state's labelled successors, and says which properties a
state, a step, a state at rest and the end must have. The checker:

- explores every reachable state once (a visited set), breadth first, so that the first
  violation found has a shortest trace;
- checks the safety invariant on every state and the step invariant on every transition;
- checks the at-rest property on every quiescent state (one with no successor but faults:
  nothing would ever happen again without one);
- then liveness: with a reverse reachability pass from the end states over every
  transition but faults, every reachable state must still be able to reach an end (a
  state that cannot is stuck: deadlocked, or in a cycle that never ends).

A violation comes with its trace from the initial state: the actions' labels and the
states they led to, each a valid step of `successors` (tests replay them).
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

Finding = tuple[str, str]
"""(the property's name, what went wrong)."""

SAFETY = "safety"
STEP = "step"
AT_REST = "at_rest"
STUCK = "stuck"


class Model(Protocol):
    """What the checker asks of a model. States must be hashable and immutable."""

    def initial(self) -> Hashable: ...

    def successors(self, state: Any) -> Iterable[tuple[str, Any]]:
        """Every action enabled in `state`, as (its label, the state it leads to)."""
        ...

    def invariant(self, state: Any) -> Finding | None:
        """What is wrong with `state` (a safety property broken), or None."""
        ...

    def step_invariant(self, before: Any, label: str, after: Any) -> Finding | None:
        """What is wrong with one transition, or None."""
        ...

    def is_fault(self, label: str) -> bool:
        """Whether the action is injected from outside (a crash, a stop, a client's
        cancel): never counted on for liveness, nor as something still to happen."""
        ...

    def at_rest(self, state: Any) -> Finding | None:
        """For a quiescent state: what is held or unfinished that nothing will ever
        release (a leak, a request that never ends), or None."""
        ...

    def is_end(self, state: Any) -> bool:
        """Whether `state` is an end: every request ended, nothing held."""
        ...

    def describe(self, state: Any) -> str:
        """`state` in one line, for traces."""
        ...


@dataclass(frozen=True)
class Step:
    label: str
    state: Any


@dataclass(frozen=True)
class Violation:
    kind: str
    """SAFETY, STEP, AT_REST or STUCK."""
    name: str
    """The property broken (the model's name for it)."""
    message: str
    trace: tuple[Step, ...]
    """From the initial state (label "initial") to the state that shows the violation."""


@dataclass(frozen=True)
class Report:
    num_states: int
    """Distinct states explored."""
    num_transitions: int
    seconds: float
    violation: Violation | None
    complete: bool = True
    """Whether every reachable state was explored (False: stopped at max_states)."""

    @property
    def ok(self) -> bool:
        return self.violation is None and self.complete

    def format(self, model: Model) -> str:
        """The outcome, and the counterexample trace if any (a step per line)."""
        head = f"{self.num_states} states, {self.num_transitions} transitions in {self.seconds:.1f} s: "
        v = self.violation
        if v is None:
            return head + ("OK (every invariant holds, no state is stuck)" if self.complete
                           else "INCOMPLETE (stopped at max_states; no violation so far)")
        lines = [head + f"VIOLATION {v.kind} {v.name}: {v.message}", f"trace ({len(v.trace) - 1} steps):"]
        for i, step in enumerate(v.trace):
            lines.append(f"{i:3d}. {step.label}")
            lines.append(f"       {model.describe(step.state)}")
        return "\n".join(lines)


def explore(model: Model, check_liveness: bool = True, max_states: int | None = None) -> Report:
    """Every state reachable from the model's initial state; stops at the first safety,
    step or at-rest violation (with a shortest trace), else checks liveness. With
    `max_states`, stops (incomplete, no liveness) once that many states are known."""
    started = time.perf_counter()
    first = model.initial()
    states: list[Any] = [first]
    index: dict[Any, int] = {first: 0}
    parent = array("q", [-1])
    labels: list[str] = ["initial"]
    # Forward edges without faults, in CSR form (edge_start[i]:edge_start[i + 1] in edges).
    edge_start = array("q")
    edges = array("q")
    num_transitions = 0
    successors, invariant, step_invariant = model.successors, model.invariant, model.step_invariant
    is_fault = model.is_fault

    def report(kind: str, finding: Finding, at: int, last: Step | None = None) -> Report:
        trace = _trace(states, parent, labels, at) + ((last,) if last is not None else ())
        return Report(len(states), num_transitions, time.perf_counter() - started,
                      Violation(kind, finding[0], finding[1], trace))

    i = 0
    while i < len(states):
        if max_states is not None and len(states) >= max_states:
            return Report(len(states), num_transitions, time.perf_counter() - started, None, complete=False)
        s = states[i]
        found = invariant(s)
        if found is not None:
            return report(SAFETY, found, i)
        edge_start.append(len(edges))
        quiet = True
        for label, t in successors(s):
            num_transitions += 1
            found = step_invariant(s, label, t)
            if found is not None:
                return report(STEP, found, i, Step(label, t))
            j = index.setdefault(t, len(states))  # (one hash of the state, new or not)
            if j == len(states):
                states.append(t)
                parent.append(i)
                labels.append(label)
            if not is_fault(label):
                quiet = False
                edges.append(j)
        if quiet:
            found = model.at_rest(s)
            if found is not None:
                return report(AT_REST, found, i)
        i += 1
    edge_start.append(len(edges))
    if check_liveness:
        stuck = _first_stuck(len(states), edge_start, edges, [model.is_end(s) for s in states])
        if stuck is not None:
            at, num_stuck = stuck
            return report(STUCK, ("can_end", f"no end is reachable from this state ({num_stuck} reachable states "
                                  "cannot reach one)"), at)
    return Report(len(states), num_transitions, time.perf_counter() - started, None)


def _trace(states: list[Any], parent: array, labels: list[str], at: int) -> tuple[Step, ...]:
    steps = []
    while at >= 0:
        steps.append(Step(labels[at], states[at]))
        at = parent[at]
    return tuple(reversed(steps))


def _first_stuck(n: int, edge_start: array, edges: array, ends: list[bool]) -> tuple[int, int] | None:
    """The first state (in breadth-first order: a shortest trace) from which no end state
    is reachable, with how many such states there are; None when there is none."""
    # Reverse the edges (CSR again), then walk back from the ends.
    counts = array("q", bytes(8 * (n + 1)))
    for j in edges:
        counts[j + 1] += 1
    for k in range(n):
        counts[k + 1] += counts[k]
    fill = array("q", counts)
    sources = array("q", bytes(8 * len(edges)))
    for i in range(n):
        for e in range(edge_start[i], edge_start[i + 1]):
            j = edges[e]
            sources[fill[j]] = i
            fill[j] += 1
    can_end = bytearray(ends)
    frontier = [i for i in range(n) if ends[i]]
    while frontier:
        j = frontier.pop()
        for e in range(counts[j], counts[j + 1]):
            i = sources[e]
            if not can_end[i]:
                can_end[i] = 1
                frontier.append(i)
    num_stuck = n - sum(can_end)
    if not num_stuck:
        return None
    return can_end.index(0), num_stuck
