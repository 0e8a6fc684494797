"""Sixteen streaming requests of every kind a migration must carry (greedy, seeded sampling,
n=2, a JSON schema, stop strings), run on a cluster at once or at a steady rate, and compared
per completion: what the cluster fault tests that move streams share (test_migration_cluster.py,
test_hung_workers.py, test_pool_changes_cluster.py)."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from typing import Any

import grpc
from fault_calls import wait_until
from metrics_text import parse_samples, total
from reference import english_token_ids
from worker_checks import inventories

from tandem.proto import generation_pb2 as pb

NUM_STREAMS = 16
MAX_TOKENS = 64
TOKENS_BEFORE_KILL = 8
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def mixed_request(tokenizer, i: int) -> pb.GenerateRequest:
    """Request i of the mix: greedy, seeded, seeded n=2, a JSON schema, stop strings, in turn."""
    prompt = english_token_ids(tokenizer, 24 + 4 * i, skip=37 * i)
    kind = i % 5
    sampling = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=100 + i, ignore_eos=True)
    if kind == 0:
        sampling = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    elif kind == 2:
        sampling.n = 2
    elif kind == 3:
        sampling.ignore_eos = False
        sampling.structured_outputs.json_schema = json.dumps(SCHEMA)
    elif kind == 4:  # held back at every "the"/"of" until the next word rules the stop strings out
        sampling = pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                     stop=["the zebra", "of the quokka"])
    return pb.GenerateRequest(request_id=f"mix-{i}", token_ids=pb.TokenIds(ids=prompt), sampling=sampling)


def read(call, out: dict[Any, Any]) -> None:
    """A stream's outputs per completion (tokens, text, finish), its code, its chunks so far."""
    out["chunks"] = 0
    try:
        for r in call:
            c = out.setdefault(r.index, {"tokens": [], "text": "", "finish": None})
            c["tokens"] += list(r.token_ids)
            c["text"] += r.text
            c["finish"] = c["finish"] or r.finish_reason or None
            out["chunks"] += 1
        out["code"] = grpc.StatusCode.OK
    except grpc.RpcError as e:
        out["code"], out["details"] = e.code(), e.details()


def outputs(out: dict[Any, Any]) -> dict[int, dict[str, Any]]:
    return {k: v for k, v in out.items() if isinstance(k, int)}


def run_mix(cluster, tokenizer, pool, before_kill=None, num_streams: int = NUM_STREAMS) -> list[dict[Any, Any]]:
    """The mix's first num_streams at once, one stream after another (least_loaded then
    alternates the decode workers); before_kill(outs), once every stream has
    TOKENS_BEFORE_KILL chunks or ended."""
    stub = cluster.stub()
    outs: list[dict[Any, Any]] = [{} for _ in range(num_streams)]
    futures = []
    for i in range(num_streams):
        futures.append(pool.submit(read, stub.Generate(mixed_request(tokenizer, i), timeout=300), outs[i]))
        wait_until(lambda: outs[i].get("chunks", 0) > 0 or "code" in outs[i], 120, f"stream {i} starts")
        time.sleep(0.15)  # the router's poller refreshes the loads
    if before_kill is not None:
        wait_until(lambda: all(o.get("chunks", 0) >= TOKENS_BEFORE_KILL or "code" in o for o in outs), 120,
                   "every stream is well under way")
        before_kill(outs)
    for f in futures:
        f.result(timeout=300)
    return outs


def assert_equal_to(reference: list[dict[Any, Any]], outs: list[dict[Any, Any]]) -> None:
    """Every stream OK, and equal to the reference's per completion (tokens, text, finish)."""
    failed = [(i, o.get("code"), o.get("details")) for i, o in enumerate(outs) if o["code"] != grpc.StatusCode.OK]
    assert not failed, failed
    differ = [i for i, (a, b) in enumerate(zip(reference, outs)) if outputs(a) != outputs(b)]
    assert not differ, [(i, outputs(reference[i]), outputs(outs[i])) for i in differ[:2]]


def decode_running(cluster) -> dict[str, int]:
    """Sequences running on each decode worker now, by its name."""
    return {i.instance: i.num_running for i in cluster.run(inventories(cluster.backend)) if i.role.value == "decode"}


class SteadyLoad:
    """The mix's requests sent one by one at ``rate_per_s`` from a thread, request k being
    mixed_request(k % NUM_STREAMS), until stop(): the load pool changes run under."""

    def __init__(self, cluster, tokenizer, rate_per_s: float) -> None:
        self.stub = cluster.stub()
        self.tokenizer = tokenizer
        self.period_s = 1 / rate_per_s
        self.outs: list[dict[Any, Any]] = []
        self._pool = concurrent.futures.ThreadPoolExecutor(64)
        self._futures: list[concurrent.futures.Future] = []
        self._stop = threading.Event()
        self._sender = threading.Thread(target=self._send, daemon=True)

    def __enter__(self) -> SteadyLoad:
        self._sender.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _send(self) -> None:
        start = time.monotonic()
        while not self._stop.is_set():
            k = len(self.outs)
            request = mixed_request(self.tokenizer, k % NUM_STREAMS)
            request.request_id = f"steady-{k}"
            self.outs.append({})
            self._futures.append(self._pool.submit(read, self.stub.Generate(request, timeout=300), self.outs[k]))
            self._stop.wait(max(0.0, start + (k + 1) * self.period_s - time.monotonic()))

    def stop(self) -> list[dict[Any, Any]]:
        """Send no more; -> every request's outputs, once each has ended."""
        self._stop.set()
        self._sender.join(timeout=30)
        for f in self._futures:
            f.result(timeout=300)
        self._pool.shutdown()
        return self.outs


def assert_steady_equal(reference: list[dict[Any, Any]], outs: list[dict[Any, Any]]) -> None:
    """A SteadyLoad's requests all OK and each equal to its mix request's uninterrupted run."""
    assert_equal_to([reference[k % NUM_STREAMS] for k in range(len(outs))], outs)


def migrations(cluster) -> tuple[float, float]:
    """tandem_request_migration_seconds' count and sum so far (what moving streams added)."""
    samples = parse_samples(cluster.scrape())
    return (total(samples, "tandem_request_migration_seconds_count"),
            total(samples, "tandem_request_migration_seconds_sum"))
