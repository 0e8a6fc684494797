"""The load generator of ``tandem bench serve``: a seeded chat/long-prompt mix, gamma
arrivals, one grpc.aio stream per request (or, with ``api="openai"``, one streamed HTTP
request to the OpenAI-compatible API: serve_openai.py), and the metrics with ``vllm bench
serve``'s definitions (TTFT, TPOT, ITL, E2EL, goodput), computed from client timestamps."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import asdict, dataclass, field, replace

import grpc
import numpy as np
from tqdm.auto import tqdm

from tandem.proto import generation_pb2 as pb
from tandem.proto import generation_pb2_grpc as pb_grpc
from tandem.router.auth import auth_token_from_env

PERCENTILES = (50, 90, 99)
APIS = ("grpc", "openai")
"""What the load drives: the gRPC API, or the OpenAI-compatible HTTP API (streamed)."""
SLO_METRICS = {"ttft": "ttft_ms", "tpot": "tpot_ms", "e2el": "e2el_ms"}
"""``--goodput`` keys -> the per-request value (ms) each bounds, as vllm bench serve."""


@dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    output_len: int
    kind: str
    """"short" (a chat turn) or "long" (a long prompt)."""


@dataclass(frozen=True)
class Mix:
    """Mostly short chats, some long prompts; lengths uniform in the closed ranges."""

    short_prompt_len: tuple[int, int] = (20, 80)
    long_prompt_len: tuple[int, int] = (600, 1200)
    output_len: tuple[int, int] = (16, 64)
    long_fraction: float = 0.2


def make_requests(num: int, token_ids: np.ndarray, mix: Mix, seed: int | list[int]) -> list[Request]:
    """``num`` requests, exactly round(num * long_fraction) of them long, in a seeded order.

    Prompts are uniform draws from ``token_ids``: no two share a prefix, so the prefix cache
    helps no one, as long as every batch sent to one server has a seed of its own."""
    for lo, hi in (mix.short_prompt_len, mix.long_prompt_len, mix.output_len):
        if not 1 <= lo <= hi:
            raise ValueError(f"length ranges must be 1 <= min <= max, got {(lo, hi)}")
    if not 0 <= mix.long_fraction <= 1 or num < 1:
        raise ValueError("long fraction must be in [0, 1] and the number of prompts >= 1")
    rng = np.random.default_rng(seed)
    num_long = round(num * mix.long_fraction)
    kinds = rng.permutation(["long"] * num_long + ["short"] * (num - num_long))
    requests = []
    for kind in kinds:
        lo, hi = mix.long_prompt_len if kind == "long" else mix.short_prompt_len
        n = int(rng.integers(lo, hi + 1))
        out = int(rng.integers(mix.output_len[0], mix.output_len[1] + 1))
        requests.append(Request([int(t) for t in rng.choice(token_ids, size=n)], out, str(kind)))
    return requests


def with_fresh_tokens(requests: list[Request], token_ids: np.ndarray, seed: int | list[int]) -> list[Request]:
    """The same requests (kinds, prompt and output lengths) with newly drawn prompt tokens: a
    workload to repeat on a server whose prefix cache has seen the first one."""
    rng = np.random.default_rng(seed)
    return [replace(r, prompt_token_ids=[int(t) for t in rng.choice(token_ids, size=len(r.prompt_token_ids))])
            for r in requests]


def arrival_offsets(num: int, rate: float, burstiness: float, seed: int | list[int]) -> list[float]:
    """Send times (s from the start): gaps drawn from gamma(shape=burstiness, mean=1/rate),
    the first request at 0, as vllm bench serve (burstiness 1: Poisson); rate inf: all at 0."""
    if burstiness <= 0 or rate <= 0:
        raise ValueError("request rate and burstiness must be > 0")
    if math.isinf(rate):
        return [0.0] * num
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=num)
    return [0.0, *np.cumsum(gaps[:-1]).tolist()]


def parse_goodput(specs: list[str]) -> dict[str, float]:
    """``["ttft:2000", "tpot:200"]`` -> {"ttft": 2000.0, "tpot": 200.0} (milliseconds)."""
    slo = {}
    for spec in specs:
        key, sep, value = spec.partition(":")
        if not sep or key not in SLO_METRICS:
            raise ValueError(f"--goodput takes KEY:MS with KEY one of {', '.join(SLO_METRICS)}, got {spec!r}")
        try:
            slo[key] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {spec!r}: {value!r} is not a number of milliseconds") from None
        if slo[key] <= 0:
            raise ValueError(f"--goodput {spec!r}: the bound must be > 0 ms")
    return slo


@dataclass
class RequestResult:
    index: int
    kind: str
    prompt_len: int
    requested_output_len: int
    send_s: float = 0.0
    """When it was sent, from the start of the run."""
    success: bool = False
    code: str | None = None
    """The call's gRPC status code by name ("OK", "RESOURCE_EXHAUSTED", ...); None until it ends.
    Over HTTP, the status's gRPC equivalent (429 -> "RESOURCE_EXHAUSTED": serve_openai.py)."""
    error: str | None = None
    output_tokens: int = 0
    usage_completion_tokens: int | None = None
    finish_reason: str | None = None
    ttft_ms: float | None = None
    """Send -> first response with non-empty token_ids or text (over HTTP: the first chunk
    with non-empty content)."""
    e2el_ms: float | None = None
    """Send -> the stream's end (or its error status)."""
    tpot_ms: float | None = None
    """(e2el - ttft) / (output_tokens - 1); None for a single output token."""
    itl_ms: list[float] = field(default_factory=list)
    """Gaps between successive non-empty responses."""
    num_chunks: int = 0
    output_token_ids: list[int] = field(default_factory=list, repr=False)
    """What the server answered (gRPC): a multi-turn session's next prompt holds it. Not in
    result_dicts."""


def greedy_request(request_id: str, token_ids: list[int], max_tokens: int) -> pb.GenerateRequest:
    """Exact output length: greedy, EOS ignored, max_tokens tokens."""
    return pb.GenerateRequest(request_id=request_id, token_ids=pb.TokenIds(ids=token_ids),
                              sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))


_FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length", pb.FINISH_REASON_ABORT: "abort"}


async def send_one(stub: pb_grpc.GenerationStub, request: Request, index: int, request_id: str,
                   timeout: float | None, metadata: tuple[tuple[str, str], ...] | None = None) -> RequestResult:
    result = RequestResult(index, request.kind, len(request.prompt_token_ids), request.output_len)
    start = last = time.perf_counter()
    try:
        async for response in stub.Generate(greedy_request(request_id, request.prompt_token_ids, request.output_len),
                                            timeout=timeout, metadata=metadata):
            now = time.perf_counter()
            if response.token_ids or response.text:
                if result.ttft_ms is None:
                    result.ttft_ms = (now - start) * 1e3
                else:
                    result.itl_ms.append((now - last) * 1e3)
                last = now
                result.num_chunks += 1
            result.output_tokens += len(response.token_ids)
            result.output_token_ids.extend(response.token_ids)
            if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                result.finish_reason = _FINISH.get(response.finish_reason, "unknown")
                result.usage_completion_tokens = response.usage.completion_tokens
        result.code = grpc.StatusCode.OK.name
    except grpc.aio.AioRpcError as e:
        result.code, result.error = e.code().name, f"{e.code().name}: {e.details()}"
    return conclude(result, start)


def conclude(result: RequestResult, start: float, end: float | None = None) -> RequestResult:
    """Stamp the end of a call sent at ``start`` (perf_counter; ``end``: when it ended, default
    now, e.g. a simulation's clock): its E2EL and, unless it failed already, success (a stop or
    length finish after a first token) with its TPOT."""
    result.e2el_ms = ((time.perf_counter() if end is None else end) - start) * 1e3
    if result.error is not None:
        return result
    if result.finish_reason in ("stop", "length") and result.ttft_ms is not None:
        result.success = True
        if result.output_tokens > 1:
            result.tpot_ms = (result.e2el_ms - result.ttft_ms) / (result.output_tokens - 1)
    else:
        result.error = f"stream ended with finish_reason {result.finish_reason}"
    return result


Send = Callable[[Request, int, str], Awaitable[RequestResult]]
"""(request, its index, its request id) -> its result: one call through an open client."""


@asynccontextmanager
async def grpc_client(target: str, timeout: float | None) -> AsyncIterator[Send]:
    """A channel to the router at ``target`` (HOST:PORT) for the run, ``send_one`` per call."""
    token = auth_token_from_env()  # the router's API key, when it wants one
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        yield lambda request, index, request_id: send_one(stub, request, index, request_id, timeout, metadata)


def open_client(api: str, target: str, *, timeout: float | None, connections: int,
                model: str | None = None) -> AbstractAsyncContextManager[Send]:
    """The client of one run on ``api`` (see APIS); ``connections`` (HTTP only): at least the
    most calls in flight at once; ``model`` (HTTP only): the body's model, default the server's."""
    if api == "grpc":
        return grpc_client(target, timeout)
    if api == "openai":
        from tandem.bench.serving.openai_api import openai_client

        return openai_client(target, timeout=timeout, connections=connections, model=model)
    raise ValueError(f"unknown api {api!r}: one of {', '.join(APIS)}")


async def run_load(target: str, requests: list[Request], offsets: list[float], *, tag: str, desc: str,
                   timeout: float | None = None, max_concurrency: int | None = None,
                   progress: bool = True, api: str = "grpc",
                   model: str | None = None) -> tuple[list[RequestResult], float]:
    """Send ``requests[i]`` at ``offsets[i]`` s (open loop; at most ``max_concurrency`` in
    flight when set) through ``api`` (one channel or HTTP session for the run) -> (results
    in request order, seconds from the first send to the last end)."""
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), desc=desc, unit="req", leave=False, disable=not progress)
    connections = max(1, max_concurrency or len(requests))
    async with open_client(api, target, timeout=timeout, connections=connections, model=model) as send:
        start = time.perf_counter()

        async def one(i: int) -> RequestResult:
            await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
            if limit:
                await limit.acquire()
            try:
                sent = time.perf_counter() - start
                result = await send(requests[i], i, f"{tag}-{i}")
                result.send_s = sent
                return result
            finally:
                if limit:
                    limit.release()
                bar.update(1)

        results = await asyncio.gather(*(one(i) for i in range(len(requests))))
        duration = time.perf_counter() - start
    bar.close()
    return list(results), duration


def stats(values: list[float]) -> dict[str, float | None]:
    """mean, median, std and p50/p90/p99 (numpy's linear percentiles, as vllm); None when empty."""
    if not values:
        return {"mean": None, "median": None, "std": None, **{f"p{p}": None for p in PERCENTILES}}
    a = np.asarray(values, dtype=float)
    return {"mean": float(a.mean()), "median": float(np.median(a)), "std": float(a.std()),
            **{f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES}}


def meets_slo(r: RequestResult, slo: dict[str, float]) -> bool:
    """A completed request within every bound (a 1-token output counts as TPOT 0, as vllm)."""
    if not r.success:
        return False
    for key, bound in slo.items():
        value = getattr(r, SLO_METRICS[key])
        if (value if value is not None else 0.0) > bound:
            return False
    return True


def summarize(results: list[RequestResult], duration: float, slo: dict[str, float]) -> dict:
    done = [r for r in results if r.success]
    good = [r for r in done if meets_slo(r, slo)]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    return {
        "completed": len(done), "failed": len(results) - len(done),
        "exact_output_len": sum(r.output_tokens == r.requested_output_len for r in done),
        "duration_s": duration, "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        "good_requests": len(good), "goodput": len(good) / duration,
        # A success has both (conclude()); the filters only tell the type checker so.
        "ttft_ms": stats([r.ttft_ms for r in done if r.ttft_ms is not None]),
        "tpot_ms": stats([r.tpot_ms for r in done if r.tpot_ms is not None]),
        "itl_ms": stats([x for r in done for x in r.itl_ms]),
        "e2el_ms": stats([r.e2el_ms for r in done if r.e2el_ms is not None]),
        "by_kind": {kind: {"completed": len(rs), "ttft_ms": stats([r.ttft_ms for r in rs if r.ttft_ms is not None]),
                           "tpot_ms": stats([r.tpot_ms for r in rs if r.tpot_ms is not None])}
                    for kind in dict.fromkeys(r.kind for r in done) if (rs := [r for r in done if r.kind == kind])},
    }


def result_dicts(results: list[RequestResult]) -> list[dict]:
    return [{k: v for k, v in asdict(r).items() if k != "output_token_ids"} for r in results]
