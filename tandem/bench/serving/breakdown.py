"""Where the time of a request goes, from the cluster's own metrics (docs/metrics.md).

``tandem bench serve`` scrapes the router's ``/metrics`` (the router's histograms and every
worker's) just before and just after a run; the difference of each histogram's ``_sum`` and
``_count`` is that run's, and sum / count its mean per request. No metric is added for this:
the parts are differences of spans the router and the workers already time. The same two
scrapes give how well a prefix-aware router predicted its workers' prefix hits during the run
(``prefix_prediction``, from its ``tandem_router_prefix_*_tokens_total`` counters).

Disaggregated (router R, prefill worker P, decode worker D; every span a mean per request;
P's transfer span starts when P admits the request, as its sender's handshake does):

- queue = R's admission queue (up to D's reservation) + P's queue (arrival to first scheduled)
  + D's transfer span - P's transfer span: the wait for P's engine loop to take the request
  (it admits between steps: up to a whole prefill chunk) and the hops, from D's reservation
  to P's admission
- prefill = P's first scheduled to first token
- first-token delivery = R's TTFT - queue - prefill: from the first token sampled on P to R
  sending it (relayed by R to D, D's next step boundary, D's stream back to R), plus R's
  validation and tokenization up front
- KV transfer tail = P's transfer span - P's queue - P's prefill: from the first token (sampled
  right after the forward that sends the last layer) to the receiver's ack, as P sees it at
  its next step boundary: what the transfer adds after the prompt's compute. D streams the
  first token without waiting for the KV (docs/architecture.md, step 12), so the tail runs
  beside the delivery, not after it: it delays the second token, not the first
- decode steps = D's first token to finish (waiting for the KV, then every decode step)

Colocated (worker C): queue = R's queue (none is kept: 0) + C's queue; prefill = C's; no
transfer; delivery = R's TTFT - queue - prefill (the first token's way out, R's validation).
Queue, prefill and delivery add up to R's TTFT by construction. Spans timed in different
processes meet at step boundaries and hops, so a part is good to some tens of milliseconds:
the queue of an idle disaggregated cluster may print a little below 0 (D's tick sees the KV
whole before P, still sampling, sees the ack).
"""

from __future__ import annotations

from collections import defaultdict

from prometheus_client.parser import text_string_to_metric_families

ROUTER = "router"
"""The role key of series without a ``role`` label (the router's own)."""
TTFT, E2E, TPOT = ("tandem_time_to_first_token_seconds", "tandem_e2e_request_latency_seconds",
                   "tandem_request_time_per_output_token_seconds")
ROUTER_QUEUE = "tandem_router_queue_time_seconds"
QUEUE, PREFILL, DECODE = ("tandem_request_queue_time_seconds", "tandem_request_prefill_time_seconds",
                          "tandem_request_decode_time_seconds")
TRANSFER = "tandem_kv_transfer_time_seconds"
DECISIONS = "tandem_prefill_decisions"
"""A counter (where, reason): kept in a Snapshot as (f"{DECISIONS}:{where}/{reason}", router) -> (count, 0)."""
PREFIX = "tandem_router_prefix"
PREFIX_COUNTERS = {"tandem_router_prefix_predicted_tokens": "predicted_tokens",
                   "tandem_router_prefix_reported_tokens": "reported_tokens",
                   "tandem_router_prefix_prediction_error_tokens": "error_tokens"}
"""The router's prefix-hit prediction counters (labels policy, role) -> their keys in a run's
``prefix_prediction``; kept in a Snapshot as (f"{PREFIX}:{key}/{policy}", router) -> (tokens, 0),
summed over roles (a cluster prefills on one: prefill or colocated)."""

PARTS = (("queue_ms", "queue (router admission + worker admission and queue)"),
         ("prefill_ms", "prefill (first scheduled -> first token)"),
         ("delivery_ms", "first-token delivery (first token -> sent by the router)"),
         ("ttft_ms", "= TTFT at the router"),
         ("transfer_tail_ms", "KV transfer tail (first token -> the decode worker's ack)"),
         ("decode_ms", "decode steps (first token -> finish, worker)"),
         ("tpot_ms", "  per output token (router TPOT)"),
         ("e2e_ms", "e2e latency at the router"))
"""The breakdown's rows in print order: (key, label)."""

Snapshot = dict[tuple[str, str], tuple[float, float]]
"""(histogram name, role) -> (sum, count), summed over the role's instances."""


def parse_histograms(text: str) -> tuple[Snapshot, bool]:
    """Prometheus text -> (every histogram's sum and count by name and role, whether every
    worker answered this scrape: a worker left out would leave its spans out)."""
    acc: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
    all_up = True
    for family in text_string_to_metric_families(text):
        if family.name == "tandem_worker_up":
            all_up = all_up and all(s.value == 1 for s in family.samples)
        if family.name == DECISIONS:
            for sample in family.samples:
                if sample.name == DECISIONS + "_total":
                    key = (f"{DECISIONS}:{sample.labels['where']}/{sample.labels['reason']}", ROUTER)
                    acc[key][0] += sample.value
        for sample in family.samples:
            counter = PREFIX_COUNTERS.get(sample.name.removesuffix("_total"))
            if counter is not None and sample.name.endswith("_total"):
                acc[(f"{PREFIX}:{counter}/{sample.labels['policy']}", ROUTER)][0] += sample.value
        if family.type != "histogram":
            continue
        for sample in family.samples:
            key = (family.name, sample.labels.get("role", ROUTER))
            if sample.name == family.name + "_sum":
                acc[key][0] += sample.value
            elif sample.name == family.name + "_count":
                acc[key][1] += sample.value
    return {key: (s, c) for key, (s, c) in acc.items()}, all_up


def difference(before: Snapshot, after: Snapshot) -> Snapshot:
    """What was observed between two scrapes of the same cluster."""
    return {key: (s - before.get(key, (0.0, 0.0))[0], c - before.get(key, (0.0, 0.0))[1])
            for key, (s, c) in after.items()}


def _mean_ms(delta: Snapshot, name: str, role: str) -> float | None:
    s, c = delta.get((name, role), (0.0, 0.0))
    return s / c * 1e3 if c > 0 else None


def prefill_decisions(delta: Snapshot) -> dict[str, int]:
    """"where/reason" -> prompts the router decided so, between two scrapes (non-zero only)."""
    prefix = DECISIONS + ":"
    return {name[len(prefix):]: int(n) for (name, _), (n, _) in delta.items() if name.startswith(prefix) and n}


def prefix_prediction(delta: Snapshot) -> dict[str, dict]:
    """policy -> how well it predicted the workers' prefix hits between two scrapes:
    predicted_tokens, reported_tokens, error_tokens (sum of abs(predicted - reported) per
    request) and relative_error = error / reported (None when nothing was reported); only the
    policies whose counters moved."""
    figures: dict[str, dict] = defaultdict(lambda: dict.fromkeys(PREFIX_COUNTERS.values(), 0))
    for (name, _), (n, _) in delta.items():
        if name.startswith(PREFIX + ":") and n:
            key, policy = name[len(PREFIX) + 1:].split("/", 1)
            figures[policy][key] += int(n)
    return {policy: {**f, "relative_error": f["error_tokens"] / f["reported_tokens"] if f["reported_tokens"] else None}
            for policy, f in figures.items()}


def breakdown(delta: Snapshot) -> dict | None:
    """The parts (ms, means per request; see the module docstring) of one run's histograms,
    or None when they lack what either formula needs (e.g. no request finished). A run with
    local prefills only (on the decode worker) is broken down as a colocated one; mixed, its
    queue and prefill parts are the remote prompts' (``prefill_decisions`` says how many)."""
    decisions = prefill_decisions(delta)
    parts = _breakdown(delta)
    return None if parts is None else {**parts, "prefill_decisions": decisions}


def _breakdown(delta: Snapshot) -> dict | None:
    mean = lambda name, role: _mean_ms(delta, name, role)  # noqa: E731
    ttft, e2e, tpot = mean(TTFT, ROUTER), mean(E2E, ROUTER), mean(TPOT, ROUTER)
    router_queue = mean(ROUTER_QUEUE, ROUTER) or 0.0  # colocated calls have no admission queue
    count = int(delta.get((E2E, ROUTER), (0.0, 0.0))[1])
    if ttft is None:
        return None
    if mean(PREFILL, "prefill") is not None:
        p_queue, p_prefill, p_transfer, d_transfer, decode = (
            mean(QUEUE, "prefill"), mean(PREFILL, "prefill"), mean(TRANSFER, "prefill"), mean(TRANSFER, "decode"),
            mean(DECODE, "decode"))
        if p_queue is None or p_prefill is None or p_transfer is None or d_transfer is None or decode is None:
            return None
        queue = router_queue + p_queue + d_transfer - p_transfer
        return {"mode": "disaggregated", "requests": count, "queue_ms": queue, "prefill_ms": p_prefill,
                "transfer_tail_ms": p_transfer - p_queue - p_prefill, "delivery_ms": ttft - queue - p_prefill,
                "ttft_ms": ttft, "decode_ms": decode, "tpot_ms": tpot, "e2e_ms": e2e,
                # Within the queue: D's reservation to P's admission.
                "prefill_admission_ms": d_transfer - p_transfer}
    # No prefill on the prefill pool: colocated, or every prompt prefilled on its decode worker.
    role = "colocated" if mean(PREFILL, "colocated") is not None else "decode"
    c_queue, c_prefill, decode = mean(QUEUE, role), mean(PREFILL, role), mean(DECODE, role)
    if c_queue is None or c_prefill is None or decode is None:
        return None
    return {"mode": "colocated" if role == "colocated" else "disaggregated", "requests": count,
            "queue_ms": router_queue + c_queue, "prefill_ms": c_prefill,
            "transfer_tail_ms": None, "delivery_ms": ttft - router_queue - c_queue - c_prefill, "ttft_ms": ttft,
            "decode_ms": decode, "tpot_ms": tpot, "e2e_ms": e2e}


async def scrape(url: str, timeout: float = 10.0) -> tuple[Snapshot, bool]:
    """GET ``url`` (a router's /metrics) -> parse_histograms of it."""
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        async with session.get(url) as response:
            response.raise_for_status()
            return parse_histograms(await response.text())


class RunScrapes:
    """The scrape before a run and the one after it -> the run's breakdown (or why none)."""

    def __init__(self, url: str | None) -> None:
        self.url = url
        self.before: Snapshot | None = None
        self.all_up = True

    async def start(self) -> None:
        if self.url is not None:
            self.before, self.all_up = await scrape(self.url)

    async def finish(self) -> dict:
        """-> {"breakdown": parts or None, "breakdown_note": why not, when one was asked for;
        "prefix_prediction": the router's figures (``prefix_prediction``), once scraped}."""
        if self.url is None or self.before is None:
            return {"breakdown": None, "breakdown_note": None}
        after, all_up = await scrape(self.url)
        delta = difference(self.before, after)
        prediction = prefix_prediction(delta)  # the router's own counters: whether every worker answered or not
        if not (self.all_up and all_up):
            return {"breakdown": None, "breakdown_note": "a worker did not answer a scrape",
                    "prefix_prediction": prediction}
        # The raw differences too, so that results.json can be broken down again another way.
        raw = {f"{name}{{role={role}}}": [s, c] for (name, role), (s, c) in sorted(delta.items()) if c > 0}
        parts = breakdown(delta)
        return {"breakdown": parts, "breakdown_note": None if parts else "the histograms lack a span",
                "histograms": raw, "prefix_prediction": prediction}
