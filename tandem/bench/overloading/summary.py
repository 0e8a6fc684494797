"""The figures of ``tandem bench overload`` from its raw records, without a cluster: call
outcomes by gRPC status and per second, the closed loop's and the overload's rates, memory
per process, other processes' CPU per phase, latency before vs after the overload, and the
reasons a run fails."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict

from tandem.bench.overloading.watch import Sample
from tandem.bench.serving.load import RequestResult, stats

OK, REFUSED, OTHER = "OK", "RESOURCE_EXHAUSTED", "other"
MAX_MESSAGES = 5
"""Distinct error messages kept per kind (the most frequent)."""
MAX_LISTED = 20
"""Request indices kept in a list of incomplete requests."""
LATENCIES = ("ttft_ms", "e2el_ms")


def _details(result: RequestResult) -> str:
    """The status message alone ("RESOURCE_EXHAUSTED: 32 requests ..." -> "32 requests ...")."""
    code, _, details = (result.error or "").partition(": ")
    return details or code


def complete(result: RequestResult) -> bool:
    """Accepted, finished normally and given every token it asked for."""
    return result.code == OK and result.success and result.output_tokens == result.requested_output_len


def outcomes(results: list[RequestResult]) -> dict:
    """How the calls ended: counts by status, accepted (OK) calls complete or not, the most
    frequent refusal and error messages, and the latency of refusals and accepted calls."""
    accepted = [r for r in results if r.code == OK]
    refused = [r for r in results if r.code == REFUSED]
    others = [r for r in results if r.code not in (OK, REFUSED)]
    return {
        "num_requests": len(results), "by_code": dict(Counter(str(r.code) for r in results)),
        "num_accepted": len(accepted), "num_refused": len(refused), "num_other": len(others),
        "num_accepted_complete": sum(map(complete, accepted)),
        "incomplete": [r.index for r in accepted if not complete(r)][:MAX_LISTED],
        "refusal_messages": Counter(map(_details, refused)).most_common(MAX_MESSAGES),
        "other_errors": Counter(str(r.error) for r in others).most_common(MAX_MESSAGES),
        "refusal_ms": stats([r.e2el_ms for r in refused if r.e2el_ms is not None]),
        **{f"accepted_{key}": stats([getattr(r, key) for r in accepted if complete(r)]) for key in LATENCIES},
    }


def per_second(results: list[RequestResult], duration_s: float) -> dict[str, list[int]]:
    """Calls by the second they were sent in (0 .. ceil(duration_s) - 1), per outcome
    ("OK", "RESOURCE_EXHAUSTED", "other"); a call sent past the last second counts in it."""
    num_bins = max(1, math.ceil(duration_s))
    counts = {OK: [0] * num_bins, REFUSED: [0] * num_bins, OTHER: [0] * num_bins}
    for r in results:
        kind = r.code if r.code in (OK, REFUSED) else OTHER
        counts[kind][min(num_bins - 1, int(r.send_s))] += 1
    return counts


def _end_s(result: RequestResult) -> float:
    return result.send_s + (result.e2el_ms or 0.0) / 1e3


def closed_loop_rate(results: list[RequestResult], concurrency: int) -> float:
    """Completed calls per second of a closed loop of ``concurrency`` slots in steady state:
    from the end of the first round (the ``concurrency``-th end: those calls were all sent at
    once and prefilled in one batch, a start no later round repeats) to the last send (every
    end sends the next call until then, so all slots stay busy; after it fewer calls are in
    flight as the last ones finish). Needs three rounds of calls per slot at least."""
    ends = sorted(map(_end_s, results))
    last_send = max(r.send_s for r in results)
    if len(ends) <= 2 * concurrency or last_send <= ends[concurrency - 1]:
        raise ValueError("a closed loop's rate needs calls that end after the first round while later ones "
                         "are still to be sent: at least three rounds")
    first_round_end = ends[concurrency - 1]
    num_ended = sum(1 for end in ends if first_round_end < end <= last_send)
    return num_ended / (last_send - first_round_end)


def accepted_rate(results: list[RequestResult]) -> float | None:
    """Complete accepted calls per second from the load's start to the last one's end (the
    cluster's throughput while overloaded; None: none completed)."""
    done = [r for r in results if complete(r)]
    return len(done) / max(map(_end_s, done)) if done else None


def last_accepted_end_s(results: list[RequestResult]) -> float | None:
    """When the last accepted call ended, seconds from the load's start (None: none accepted)."""
    return max((_end_s(r) for r in results if r.code == OK), default=None)


def _last_at(samples: list[Sample], t_s: float) -> Sample:
    """The last sample at or before t_s (the first one when none is)."""
    return max((s for s in samples if s.t_s <= t_s), key=lambda s: s.t_s, default=samples[0])


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def memory(samples: list[Sample], overload_start_s: float, overload_end_s: float) -> dict[str, dict]:
    """Per process (MiB): ``start`` (the last sample before the overload), ``peak`` (from then
    on), ``end`` (the last sample), ``growth`` (end - start) and ``late_growth`` (the last
    sample of the overload minus the one at its middle: ~0 once queues are full, if bounded)."""
    start, end = _last_at(samples, overload_start_s), samples[-1]
    middle, late = _last_at(samples, (overload_start_s + overload_end_s) / 2), _last_at(samples, overload_end_s)
    out = {}
    for name in start.rss_mib:
        seen = [v for s in samples if s.t_s >= overload_start_s and (v := s.rss_mib.get(name)) is not None]
        out[name] = {"start": start.rss_mib[name], "peak": max(seen, default=None), "end": end.rss_mib.get(name),
                     "growth": _minus(end.rss_mib.get(name), start.rss_mib[name]),
                     "late_growth": _minus(late.rss_mib.get(name), middle.rss_mib.get(name))}
    return out


def other_cpu_by_phase(samples: list[Sample], phases: dict[str, float]) -> dict[str, float | None]:
    """Mean cores other processes on the machine kept busy during each phase (``phases``: name
    -> start, in order; a phase ends where the next starts, the last one has no samples). A
    sample covers the time since the one before it, so it counts in the phase it ends in."""
    starts = list(phases.items())
    out = {}
    for (name, start), (_, end) in zip(starts, starts[1:]):
        values = [s.other_cpu_cores for s in samples if start < s.t_s <= end]
        out[name] = sum(values) / len(values) if values else None
    return out


def baseline(results: list[RequestResult], rate: float) -> dict:
    """An open-loop run at ``rate``: how many completed, and their TTFT and E2E latency."""
    done = [r for r in results if complete(r)]
    return {"rate": rate, "num_requests": len(results), "num_complete": len(done),
            **{key: stats([getattr(r, key) for r in done]) for key in LATENCIES}}


def _ratio(after: float | None, before: float | None) -> float | None:
    return None if after is None or not before else after / before


def recovery(before: dict, after: dict) -> dict[str, dict[str, float | None]]:
    """after / before of each latency's p50 and p99 (1: back to normal)."""
    return {key: {p: _ratio(after[key][p], before[key][p]) for p in ("p50", "p99")} for key in LATENCIES}


def failures(result: dict) -> list[str]:
    """Why the run fails (the command then exits 1); [] when it passes. ``result`` is the
    results.json dict."""
    o, load = result["overload"]["outcomes"], result["overload"]
    found = []
    if o["num_other"]:
        found.append(f"{o['num_other']} calls ended with a status other than OK or RESOURCE_EXHAUSTED: "
                     + "; ".join(f"{n}x {error}" for error, n in o["other_errors"]))
    if o["num_accepted_complete"] != o["num_accepted"]:
        found.append(f"{o['num_accepted'] - o['num_accepted_complete']} of {o['num_accepted']} accepted calls did "
                     f"not get all their tokens (indices {o['incomplete']})")
    if load["peak_in_progress"] > load["max_concurrent_requests"]:
        found.append(f"{load['peak_in_progress']} calls were in progress at once, past the bound "
                     f"{load['max_concurrent_requests']}")
    if result["drain"]["held"]:
        found.append(f"the workers were not empty {result['drain']['timeout_s']:g} s after the overload: "
                     f"{result['drain']['held']}")
    after = result["after"]
    if after["num_complete"] != after["num_requests"]:
        found.append(f"after the overload, {after['num_requests'] - after['num_complete']} of "
                     f"{after['num_requests']} calls at 0.5x the sustainable rate did not complete")
    return found


def request_records(results: list[RequestResult]) -> list[dict]:
    """The overload's calls for results.json, without their token gaps (thousands of calls)."""
    keep = ("index", "send_s", "code", "e2el_ms", "ttft_ms", "output_tokens", "requested_output_len")
    return [{k: v for k, v in asdict(r).items() if k in keep} for r in results]
