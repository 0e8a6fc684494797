"""How well the prefix-aware policies predict prefix-cache hits: for each request placed on a
colocated or (remote prefill) prefill worker, the router counts the hit it predicted for that
worker and the hit the worker then reported, and their absolute difference; a request that
fails before its worker reports counts in none. Scripted fake workers, no Ray."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from test_burst_spread import idle
from test_worker_health import Handle, Method

from tandem.kvcache.block_hash import prefix_hashes
from tandem.router import worker_stream
from tandem.router.backend import NoHealthyWorker, WorkerFailed
from tandem.router.metrics import RouterMetrics
from tandem.router.policy import WorkerState
from tandem.router.ray_backend import RayBackend
from tandem.sampling_params import SamplingParams
from tandem.worker.api import KVSource, PrefillResult, Role, StreamDelta, WorkerRequest
from tandem.worker.delta_outbox import DeltaOutbox

BLOCK_SIZE = 16  # test_burst_spread.idle's
PROMPT = list(range(1, 41))
"""40 tokens: 2 full blocks the router may predict as held (never the last token's block)."""


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    """A stream left early is cancelled with ray.cancel, which would start a local Ray for these
    fakes: a no-op instead."""
    monkeypatch.setattr(worker_stream.ray, "cancel", lambda call: None)


class Streaming:
    """A worker's streaming method's stand-in: .remote(*args, inbox) -> an awaitable that sends
    each of the deltas ``deltas(*args)`` gives (a list, or a queue read up to a last delta) to
    the router's inbox over a real socket, as the worker's DeltaOutbox does, then returns."""

    def __init__(self, deltas: Callable[..., list[StreamDelta] | asyncio.Queue[StreamDelta]]) -> None:
        self.deltas = deltas
        self.outbox = DeltaOutbox()

    def remote(self, *args):
        deltas = self.deltas(*args[:-1])
        inbox = args[-1]

        async def call() -> None:
            if isinstance(deltas, list):
                for delta in deltas:
                    self.outbox.send(inbox, delta)
                return
            while True:
                delta = await deltas.get()
                self.outbox.send(inbox, delta)
                if delta.request_finished or delta.finish_reason == "abort":
                    return
        return call()


class ColocatedHandle(Handle):
    def __init__(self, load, generate: Streaming) -> None:
        super().__init__(load)
        self.generate = generate


class PrefillHandle(Handle):
    def __init__(self, load, prefill: Callable[..., PrefillResult]) -> None:
        super().__init__(load)
        self.prefill = Method(prefill)


class DecodeHandle(Handle):
    def __init__(self, load, stream: Streaming, start: Callable[[PrefillResult], None],
                 abort: Callable[[str], bool]) -> None:
        super().__init__(load, reserve=lambda request: "reservation")
        self.stream, self.start, self.abort = stream, Method(start), Method(abort)


def delta(request_id: str, num_cached_tokens: int, token_ids: list[int] | None = None,
          finish_reason: str | None = "stop", error: str | None = None) -> StreamDelta:
    tokens = [7] if token_ids is None else token_ids
    return StreamDelta(request_id, tokens, "x" * len(tokens), finish_reason, len(PROMPT), len(tokens), error=error,
                       num_cached_tokens=num_cached_tokens)


def counted(metrics: RouterMetrics, policy: str, role: str) -> tuple[float | None, ...]:
    """(predicted, reported, |error|) tokens the router's counters hold."""
    labels = {"model_name": "m", "policy": policy, "role": role}
    return tuple(metrics.registry.get_sample_value(f"tandem_router_prefix_{name}_tokens_total", labels)
                 for name in ("predicted", "reported", "prediction_error"))


def test_colocated_workers_report_their_hit_on_the_first_tokens(router_tokenizer):
    # Each call's script, in call order: the hit the worker reports, or None: the request fails first.
    reports = [0, 16, None, 16]

    def generate(request: WorkerRequest) -> list[StreamDelta]:
        found = reports.pop(0)
        if found is None:
            return [delta(request.request_id, 0, [], finish_reason="abort", error="the engine stopped")]
        return [delta(request.request_id, found, [7], finish_reason=None), delta(request.request_id, found, [8])]

    workers = [WorkerState(f"c-{i}", ColocatedHandle(lambda i=i: idle(Role.COLOCATED, f"c-{i}"), Streaming(generate)))
               for i in range(2)]
    backend = RayBackend([], [], workers, "prefix_aware", router_tokenizer.spec)
    backend.metrics = metrics = RouterMetrics("m", 2048)

    async def run(prompt: list[int]) -> list[StreamDelta]:
        return [d async for d in backend.generate("r", prompt, SamplingParams(max_tokens=2))]

    async def body():
        try:
            await main()
        finally:
            await backend.stop_polling()  # the sockets of its inbox (and KV event feed) closed

    async def main():
        await backend.health.refresh()
        await run(PROMPT)  # nothing routed yet: predicted 0, found 0
        assert counted(metrics, "prefix_aware", "colocated") == (0, 0, 0)
        # The router remembers c-0 holds PROMPT's 2 full blocks; c-0 found one of them.
        deltas = await run(PROMPT[:32] + [900] * 8)  # (one or two: the router merges what arrives together)
        assert [t for d in deltas for t in d.token_ids] == [7, 8] and {d.num_cached_tokens for d in deltas} == {16}
        assert counted(metrics, "prefix_aware", "colocated") == (32, 16, 16)
        with pytest.raises(WorkerFailed):  # predicted 32 again, but no report: counted nowhere
            await run(PROMPT)
        assert counted(metrics, "prefix_aware", "colocated") == (32, 16, 16)
        await run(list(range(500, 540)))  # never routed before, yet a worker held a block of it
    asyncio.run(body())
    assert reports == []
    # predicted == reported, and still every predicted token off: the error counter tells.
    assert counted(metrics, "prefix_aware", "colocated") == (32, 32, 32)
    assert counted(metrics, "prefix_aware", "prefill") == (0, 0, 0)  # every series from the start
    assert counted(metrics, "precise_prefix", "colocated") == (0, 0, 0)


def test_a_prefill_worker_reports_its_hit_against_the_precise_index(router_tokenizer):
    """precise_prefix predicts from the KV index: a block held on disk counts whole (the worker
    loads it back as a hit), though routing weighs it less."""
    reports: list[int | None] = [32, 16, None]
    streams: dict[str, asyncio.Queue[StreamDelta]] = {}

    def prefill(request: WorkerRequest, destination) -> PrefillResult:
        found = reports.pop(0)
        if found is None:
            raise RuntimeError("the prefill failed")
        return PrefillResult(request.request_id, [7], [0.0], found)

    def stream(request_id: str) -> asyncio.Queue[StreamDelta]:
        return streams.setdefault(request_id, asyncio.Queue())

    def start(first: PrefillResult) -> None:
        # The decode worker's own hit is not the prediction's: it is left out.
        stream(first.request_id).put_nowait(delta(first.request_id, 99, first.token_ids))

    def abort(request_id: str) -> bool:
        stream(request_id).put_nowait(delta(request_id, 0, [], finish_reason="abort"))
        return True

    prefill_handle = PrefillHandle(lambda: idle(Role.PREFILL, "p-0"), prefill)
    decode_handle = DecodeHandle(lambda: idle(Role.DECODE, "d-0"), Streaming(stream), start, abort)
    backend = RayBackend([WorkerState("p-0", prefill_handle)], [WorkerState("d-0", decode_handle)], [],
                         "precise_prefix", router_tokenizer.spec, disagg_policy="always")
    backend.metrics = metrics = RouterMetrics("m", 2048)
    assert backend.kv_index is not None
    pool_block, disk_block = prefix_hashes(PROMPT, BLOCK_SIZE, 2)
    backend.kv_index.resync("p-0", "epoch-1", 0, {pool_block: ["pool"], disk_block: ["disk"]})

    async def run(prompt: list[int]) -> None:
        async for _ in backend.generate("r", prompt, SamplingParams(max_tokens=1)):
            pass

    async def body():
        try:
            await main()
        finally:
            await backend.stop_polling()  # the sockets of its inbox (and KV event feed) closed

    async def main():
        await backend.health.refresh()
        p_0 = backend.prefill[0]
        assert backend.prefill_router.num_cached_tokens(p_0, PROMPT) == 28  # routing's view: the disk block is 0.8
        assert backend.prefill_router.num_cached_tokens(p_0, PROMPT, weighted=False) == 32
        await run(PROMPT)  # predicted 32, found 32
        assert counted(metrics, "precise_prefix", "prefill") == (32, 32, 0)
        await run(list(range(500, 540)))  # predicted 0, found a block the index had not heard of
        with pytest.raises(NoHealthyWorker, match="prefill failed"):  # no report: counted nowhere
            await run(PROMPT)
    asyncio.run(body())
    assert reports == []
    assert counted(metrics, "precise_prefix", "prefill") == (32, 48, 16)
    assert counted(metrics, "precise_prefix", "colocated") == (0, 0, 0)


def test_policies_that_predict_nothing_count_nothing(router_tokenizer):
    handle = ColocatedHandle(lambda: idle(Role.COLOCATED, "c-0"),
                             Streaming(lambda request: [delta(request.request_id, 16)]))
    backend = RayBackend([], [], [WorkerState("c-0", handle)], "least_loaded", router_tokenizer.spec)
    backend.metrics = metrics = RouterMetrics("m", 2048)

    async def body():
        try:
            await main()
        finally:
            await backend.stop_polling()  # the sockets of its inbox (and KV event feed) closed

    async def main():
        await backend.health.refresh()
        async for _ in backend.generate("r", PROMPT, SamplingParams(max_tokens=1)):
            pass
    asyncio.run(body())
    for policy in ("prefix_aware", "precise_prefix"):
        assert counted(metrics, policy, "colocated") == (0, 0, 0)
    assert metrics.registry.get_sample_value("tandem_router_prefix_reported_tokens_total", {
        "model_name": "m", "policy": "least_loaded", "role": "colocated"}) is None


@pytest.mark.parametrize("role", [Role.COLOCATED, Role.PREFILL])
def test_blocks_the_worker_is_sent_to_fetch_are_predicted_as_hits(router_tokenizer, role):
    """A worker pointed at another's tier server (a KVSource) loads the blocks it fetches as
    hits: the prediction counts them, and a fetch that brings nothing shows as error."""
    reports = [32, 0]
    sources: list[KVSource | None] = []

    def found(request: WorkerRequest) -> int:
        sources.append(request.kv_source)
        return reports.pop(0)

    def generate(request: WorkerRequest) -> list[StreamDelta]:
        return [delta(request.request_id, found(request))]

    def start(first: PrefillResult) -> None:
        streams[first.request_id].put_nowait(delta(first.request_id, 0, first.token_ids))

    streams: dict[str, asyncio.Queue[StreamDelta]] = {}
    if role is Role.COLOCATED:
        worker = WorkerState("w-0", ColocatedHandle(lambda: idle(role, "w-0"), Streaming(generate)))
        backend = RayBackend([], [], [worker], "precise_prefix", router_tokenizer.spec)
    else:
        prefill = PrefillHandle(lambda: idle(role, "w-0"),
                                lambda request, _: PrefillResult(request.request_id, [7], [0.0], found(request)))
        decode = DecodeHandle(lambda: idle(Role.DECODE, "d-0"),
                              Streaming(lambda request_id: streams.setdefault(request_id, asyncio.Queue())),
                              start, lambda request_id: True)
        backend = RayBackend([WorkerState("w-0", prefill)], [WorkerState("d-0", decode)], [], "precise_prefix",
                             router_tokenizer.spec, disagg_policy="always")
    backend.metrics = metrics = RouterMetrics("m", 2048)
    assert backend.kv_index is not None and backend.kv_feed is not None
    # A worker on another host holds both of PROMPT's full blocks in its pool; w-0 none.
    backend.kv_index.resync("far", "epoch-1", 0, {h: ["pool"] for h in prefix_hashes(PROMPT, BLOCK_SIZE, 2)})
    backend.kv_feed.tier_addresses["far"] = "tcp://10.0.0.9:7000"

    async def body():
        try:
            await main()
        finally:
            await backend.stop_polling()  # the sockets of its inbox (and KV event feed) closed

    async def main():
        await backend.health.refresh()
        for _ in range(2):
            async for _ in backend.generate("r", PROMPT, SamplingParams(max_tokens=1)):
                pass
    asyncio.run(body())
    assert sources == [KVSource("tcp://10.0.0.9:7000", 2)] * 2
    # Predicted 32 twice: found by the first fetch, not by the second (its peer had gone).
    assert counted(metrics, "precise_prefix", role.value) == (64, 32, 32)
