"""The DistServe-style figure: the highest request rate a setup sustains with a share of its
requests (ATTAINMENT, 90%) within the SLO (TTFT and TPOT bounds), found by probing rates.

A probe is one run of the same workload at one rate on a fresh cluster (a warm prefix cache
would flatter later probes); the sweep's runs at the searched setup count as probes too.
The search doubles the rate from the highest that passed until one fails (halves from the
lowest that failed while none passed), then bisects between the highest pass below the
lowest fail and that fail, within a budget of probes. Its answer (``max_rate``) is that
highest pass; ``bound`` says how far to trust it: "bracketed" (the next probe above
failed), "lower" (nothing above failed before the budget ran out: the true one is at least
this) or "none" (even the lowest probe failed)."""

from __future__ import annotations

ATTAINMENT = 0.9
RESOLUTION = 0.1
"""Bisection stops when the bracket is this narrow: (fail - pass) / pass."""
MIN_RATE = 0.05
"""No probe below this (req/s): a probe lasts about num_prompts / rate seconds."""


def attainment(metrics: dict) -> float:
    """Share of the run's requests within every SLO bound (a failed request is not)."""
    total = metrics["completed"] + metrics["failed"]
    return metrics["good_requests"] / total if total else 0.0


class RateSearch:
    """Which rate to probe next, from the probes so far (rate -> passed)."""

    def __init__(self, start: float, resolution: float = RESOLUTION, min_rate: float = MIN_RATE) -> None:
        self.start, self.resolution, self.min_rate = start, resolution, min_rate
        self.passed: dict[float, bool] = {}

    def record(self, rate: float, passed: bool) -> None:
        self.passed[rate] = passed

    def lowest_fail(self) -> float | None:
        fails = [r for r, ok in self.passed.items() if not ok]
        return min(fails) if fails else None

    def max_rate(self) -> float | None:
        """The highest rate that passed below the lowest that failed (a pass above a fail is
        noise the answer does not trust)."""
        hi = self.lowest_fail()
        passes = [r for r, ok in self.passed.items() if ok and (hi is None or r < hi)]
        return max(passes) if passes else None

    def bound(self) -> str:
        if self.max_rate() is None:
            return "none"
        return "bracketed" if self.lowest_fail() is not None else "lower"

    def next_rate(self) -> float | None:
        """The next rate to probe; None when the answer is as narrow as the resolution, or
        the rate would go below min_rate."""
        if not self.passed:
            return self.start
        lo, hi = self.max_rate(), self.lowest_fail()
        if hi is None:
            assert lo is not None  # something passed, nothing failed
            return 2 * lo
        if lo is None:
            return hi / 2 if hi / 2 >= self.min_rate else None
        if (hi - lo) / lo <= self.resolution:
            return None
        return round((lo + hi) / 2, 4)


def max_rate_ratio(d: dict, c: dict) -> tuple[float | None, str]:
    """Disaggregated / colocated max SLO rate from their search results -> (value, qualifier):
    "=" when both are bracketed, ">=" or "<=" when one is a bound that way, "?" when nothing
    can be said (value None)."""
    from tandem.bench.serving.sweep import ratio

    dr, cr, db, cb = d["max_rate"], c["max_rate"], d["bound"], c["bound"]
    if cb == "none" and dr is not None:
        # Colocated sustained no rate probed: its max is below its lowest probe.
        low = min(p["rate"] for p in c["probes"])
        return ratio(dr, low), ">="
    if db == "none" and cr is not None and cb == "bracketed":
        return ratio(min(p["rate"] for p in d["probes"]), cr), "<="
    if dr is None or cr is None:
        return None, "?"
    value = ratio(dr, cr)
    if db == "bracketed" and cb == "bracketed":
        return value, "="
    if db == "lower" and cb == "bracketed":
        return value, ">="
    if db == "bracketed" and cb == "lower":
        return value, "<="
    return value, "?"


def ratio_goal(value: float | None, qualifier: str, bound: float) -> str:
    """ "held", "missed" or "unknown" for a ratio goal of >= bound, given what the qualifier allows."""
    if value is None or qualifier == "?":
        return "unknown"
    if value >= bound:
        return "held" if qualifier in ("=", ">=") else "unknown"
    return "missed" if qualifier in ("=", "<=") else "unknown"


def search_summary(search: RateSearch, probes: list[dict], label: str, budget: int | None) -> dict:
    """One setup's search for results.json: its probes by rate and its answer."""
    return {"label": label, "budget": budget, "probes": sorted(probes, key=lambda p: p["rate"]),
            "max_rate": search.max_rate(), "bound": search.bound(), "next_failed_rate": search.lowest_fail()}
