"""Calls and waits the cluster fault tests share."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
from reference import english_token_ids

from tandem.proto import generation_pb2 as pb

CLEAR = {grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.OK}


def request(token_ids: list[int], max_tokens: int) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=token_ids),
                              sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


def assert_serves(cluster, tokenizer, max_tokens: int = 4) -> None:
    responses = list(cluster.stub().Generate(request(english_token_ids(tokenizer, 12), max_tokens), timeout=120))
    assert sum(len(r.token_ids) for r in responses) == max_tokens
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH


def read_to_end(call, first: threading.Event, out: dict) -> None:
    """Read a streaming call to its end: out gets its code and when it ended."""
    try:
        for _ in call:
            first.set()
        out["code"] = grpc.StatusCode.OK
    except grpc.RpcError as e:
        out["code"] = e.code()
        out["details"] = e.details()
    out["ended"] = time.monotonic()
    first.set()


async def awaited(ref):
    return await ref


def wait_until(predicate, timeout: float, what: str, state=None) -> float:
    """Poll predicate until true; past timeout fail naming `what` and, if given, state()."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, \
            f"not within {timeout} s: {what}" + ("" if state is None else f" ({state()})")
        time.sleep(0.05)
    return time.monotonic() - start


def decode_inventories(cluster) -> list:
    """The decode workers' WorkerInventory. (The prefill worker, while Ray restarts it,
    answers no inventory call.)"""
    async def gather():
        return await asyncio.gather(*(asyncio.wait_for(w.handle.inventory.remote(), 10)
                                      for w in cluster.backend.decode))
    return cluster.run(gather())


def decode_leaks(cluster) -> dict[str, list[str]]:
    """What the decode workers (and the router's admission queue) still hold: {} at rest."""
    found = {i.instance: i.leaks() for i in decode_inventories(cluster) if not i.is_empty}
    if cluster.backend.num_admitting:
        found["router"] = [f"num_admitting={cluster.backend.num_admitting}"]
    return found


def greedy(cluster, prompt: list[int], max_tokens: int) -> list[int]:
    responses = list(cluster.stub().Generate(request(prompt, max_tokens), timeout=120))
    assert responses[-1].finish_reason == pb.FINISH_REASON_LENGTH
    return [t for r in responses for t in r.token_ids]


HandoffTraces = dict[tuple[str, str, int], list[tuple[str, str, str]]]
"""(side, worker instance, pid) -> the moves its handoff table recorded (see test_worker_traces)."""


def read_handoff_traces(cluster, traces: HandoffTraces) -> None:
    """Add the latest traces of the cluster's prefill and decode workers to `traces` (a worker
    that does not answer now, being stopped or restarted, is read next time)."""
    workers = [("prefill", w) for w in cluster.backend.prefill] + [("decode", w) for w in cluster.backend.decode]

    async def read(w):
        return await asyncio.wait_for(asyncio.gather(w.handle.pid.remote(), w.handle.handoff_trace.remote()), 5)

    async def read_all():
        return await asyncio.gather(*(read(w) for _, w in workers), return_exceptions=True)

    for (side, w), got in zip(workers, cluster.run(read_all())):
        if not isinstance(got, BaseException):
            pid, trace = got
            traces[(side, w.instance, pid)] = trace
