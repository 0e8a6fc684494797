"""Requests of the compatibility matrix and their outputs: served through a cluster's router
(or a router over some of its workers), compared token for token."""

from __future__ import annotations

import asyncio

from running_cluster import RunningCluster

from tandem import SamplingParams
from tandem.router.ray_backend import RayBackend

Completion = tuple[list[int], list[float] | None, list[tuple[list[int], list[float]]] | None]
Outcome = list[Completion]
"""One request's completions, by index: token ids, log-probabilities, top log-probabilities."""
Call = tuple[list[int], SamplingParams]


async def _generate(backend: RayBackend, request_id: str, prompt: list[int], params: SamplingParams,
                    fresh_loads: bool) -> Outcome:
    if fresh_loads:  # a router that does not poll: fresh loads (block sizes, room) before routing
        await backend.loads()
    found: dict[int, Completion] = {}
    async for d in backend.generate(request_id, prompt, params):
        assert d.error is None, f"{request_id} failed: {d.error}"
        ids, lps, tops = found.setdefault(d.index, ([], None if d.logprobs is None else [],
                                                    None if d.top_logprobs is None else []))
        ids += d.token_ids
        if lps is not None and d.logprobs is not None:
            lps += d.logprobs
        if tops is not None and d.top_logprobs is not None:
            tops += [(list(t.token_ids), list(t.logprobs)) for t in d.top_logprobs]
    assert sorted(found) == list(range(params.n)), (request_id, sorted(found))
    return [found[i] for i in range(params.n)]


_ids = iter(range(10**9))


def serve(cluster: RunningCluster, calls: list[Call], backend: RayBackend | None = None,
          at_once: bool = False) -> list[Outcome]:
    """Each call's outcome on ``cluster`` (through ``backend``, a router over some of its
    workers, when given): one after another, or all at once."""
    b = backend or cluster.backend
    fresh = backend is not None

    async def run() -> list[Outcome]:
        coros = [_generate(b, f"cm-{next(_ids)}", p, params, fresh) for p, params in calls]
        if at_once:
            return list(await asyncio.gather(*coros))
        return [await c for c in coros]
    return list(cluster.run(run()))


def first_difference(got: list[Outcome], want: list[Outcome], calls: list[Call]) -> str | None:
    """None when equal (ids exactly, log-probabilities within 1e-3); else where they first differ."""
    for i, (g, w) in enumerate(zip(got, want)):
        for j, ((gi, gl, gt), (wi, wl, wt)) in enumerate(zip(g, w)):
            where = f"request {i} (prompt of {len(calls[i][0])} tokens, {calls[i][1]!r}) completion {j}"
            if gi != wi:
                k = next((k for k, (a, b) in enumerate(zip(gi, wi)) if a != b), min(len(gi), len(wi)))
                return (f"{where}: token {k} differs: disaggregated {gi[k:k + 1]} vs colocated {wi[k:k + 1]} "
                        f"(disaggregated {gi}, colocated {wi})")
            if (gl is None) != (wl is None) or (gt is None) != (wt is None):
                return f"{where}: log-probabilities given on one side only"
            if gl is not None and wl is not None:
                for k, (a, b) in enumerate(zip(gl, wl)):
                    if abs(a - b) > 1e-3:
                        return f"{where}: logprob of token {k}: {a} vs {b}"
            if gt is not None and wt is not None:
                for k, ((ti, tl), (ui, ul)) in enumerate(zip(gt, wt)):
                    if ti != ui or any(abs(a - b) > 1e-3 for a, b in zip(tl, ul)):
                        return f"{where}: top logprobs at token {k}: {list(zip(ti, tl))} vs {list(zip(ui, ul))}"
        if len(g) != len(w):
            return f"request {i}: {len(g)} completions vs {len(w)}"
    return None
