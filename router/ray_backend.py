"""The router's Backend over Ray actor workers: disaggregated (prefill pool + decode pool)
or colocated. Picks workers by policy, runs a request's phases, aborts on every exit."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from typing import TYPE_CHECKING, AsyncIterator

from ray.exceptions import RayTaskError

from tandem.router.admission import AdmissionQueue
from tandem.router.backend import NoHealthyWorker, WorkerFailed
from tandem.router.disagg import DEFAULT_MAX_LOCAL_STALL_S, PrefillCosts, make_disagg_policy
from tandem.router.kv_events_feed import KVEventFeed
from tandem.router.kv_index import KVBlockIndex
from tandem.router.kv_sources import kv_source_for
from tandem.router.policy import Router, WorkerState
from tandem.router.prefill_placement import PrefillPlacement, learn, place, place_colocated
from tandem.router.prefix_prediction import predict
from tandem.router.worker_calls import WORKER_GONE, WorkerCalls, short_error
from tandem.router.worker_health import WorkerHealth
from tandem.router.worker_metrics import WorkerMetricsReport
from tandem.router.worker_stream import WorkerStreams
from tandem.sampling_params import SamplingParams
from tandem.worker.api import KVSource, PoolFull, Role, StreamDelta, TokenizerSpec, WorkerLoad, WorkerRequest

if TYPE_CHECKING:
    from tandem.router.metrics import RouterMetrics
    from tandem.router.pool_changes import PoolChanges

logger = logging.getLogger(__name__)

WORKER_METRICS_TIMEOUT_S = 1.0


class RayBackend:
    def __init__(self, prefill: list[WorkerState], decode: list[WorkerState], colocated: list[WorkerState],
                 policy: str, tokenizer_spec: TokenizerSpec, max_queued_requests: int = 1024,
                 admission_timeout_s: float = 60.0, disagg_policy: str = "auto",
                 max_local_stall_s: float = DEFAULT_MAX_LOCAL_STALL_S) -> None:
        """max_queued_requests: requests waiting for a decode worker with room before new
        ones are refused; admission_timeout_s: how long one waits. disagg_policy: where each
        prompt is prefilled (router/disagg.py), with max_local_stall_s for auto."""
        if colocated and (prefill or decode):
            raise ValueError("either colocated workers or prefill and decode pools, not both")
        if not colocated and not (prefill and decode):
            raise ValueError("a disaggregated cluster needs at least one prefill and one decode worker")
        self.prefill, self.decode, self.colocated = prefill, decode, colocated
        self.kv_index = KVBlockIndex() if policy == "precise_prefix" else None
        """Where the workers' KV events say each prefix block is (precise_prefix only)."""
        self.kv_feed = None if self.kv_index is None else KVEventFeed(self.kv_index)
        self.prefill_router = Router(policy, kv_index=self.kv_index)
        self.decode_router = Router(policy, for_decode=True, kv_index=self.kv_index)
        self.tokenizer_spec = tokenizer_spec
        self.admission = AdmissionQueue(max_queued_requests, admission_timeout_s)
        self.prefill_costs = PrefillCosts()
        self.disagg = make_disagg_policy(disagg_policy, self.prefill_costs, max_local_stall_s)
        self.calls = WorkerCalls()
        self.streams = WorkerStreams(self.calls, self.mark_unhealthy)
        """The requests' output streams (their deltas reach the router's inbox socket)."""
        self.health = WorkerHealth(self.workers, decode, self.calls, self.admission.room_freed)
        self._worker_ids: dict[str, set[str]] = {}
        """The client's request id -> the ids its calls have on the workers."""
        self.metrics: RouterMetrics | None = None
        self.pool_changes: PoolChanges | None = None
        """Draining, adding and scaling its workers (set by cluster.start_cluster)."""

    @property
    def num_admitting(self) -> int:
        return self.admission.num_waiting

    @property
    def workers(self) -> list[WorkerState]:
        return self.prefill + self.decode + self.colocated

    async def worker_metrics(self) -> list[WorkerMetricsReport]:
        async def one(role: Role, w: WorkerState) -> WorkerMetricsReport:
            try:
                text = await asyncio.wait_for(w.handle.metrics_text.remote(), WORKER_METRICS_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - dead, restarting or busy: left out of this scrape
                logger.warning("worker %s did not report its metrics: %s", w.instance, e)
                text = None
            return WorkerMetricsReport(role.value, w.instance, text, w.healthy)
        pools = ((Role.PREFILL, self.prefill), (Role.DECODE, self.decode), (Role.COLOCATED, self.colocated))
        return list(await asyncio.gather(*(one(role, w) for role, ws in pools for w in ws)))

    def is_ready(self) -> bool:
        """Every pool in use has a healthy worker: one restarting worker does not take the
        router out of service (its requests go to the others meanwhile)."""
        pools = (self.colocated,) if self.colocated else (self.prefill, self.decode)
        return all(any(w.routable for w in pool) for pool in pools)

    def add_worker(self, role: Role, w: WorkerState) -> None:
        """A worker that serves joins ``role``'s pool (router/pool_changes.py)."""
        {Role.PREFILL: self.prefill, Role.DECODE: self.decode, Role.COLOCATED: self.colocated}[role].append(w)
        self.health.add(w)
        if self.kv_feed is not None:
            self.calls.later(self.kv_feed.subscribe(w), f"following {w.instance}'s KV events")

    def remove_worker(self, role: Role, w: WorkerState) -> None:
        """A drained worker leaves ``role``'s pool and the health polls."""
        {Role.PREFILL: self.prefill, Role.DECODE: self.decode, Role.COLOCATED: self.colocated}[role].remove(w)
        self.health.workers.remove(w)
        if self.kv_feed is not None:
            self.kv_feed.forget(w)

    async def loads(self) -> list[WorkerLoad]:
        await self.health.refresh()
        return [w.load for w in self.workers if w.load is not None]

    def start_polling(self) -> None:
        """Keep worker loads (and health), and the KV index, fresh in the background."""
        self.health.start()
        if self.kv_feed is not None:
            self.kv_feed.start()
            for w in self.workers:
                self.calls.later(self.kv_feed.subscribe(w), f"following {w.instance}'s KV events")

    async def stop_polling(self) -> None:
        await self.health.stop()
        if self.kv_feed is not None:
            await self.kv_feed.stop()
        await self.streams.inbox.stop()

    def mark_unhealthy(self, w: WorkerState, why: str | BaseException = "died") -> None:
        self.health.mark_down(w, why)

    async def abort(self, request_id: str) -> bool:
        """Abort the client's request(s) with this id on every worker."""
        ids = list(self._worker_ids.get(request_id, ()))
        results = await asyncio.gather(*(self.calls.abort_on(self.workers, i) for i in ids))
        return any(r is True for rs in results for r in rs)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       priority: int = 0, num_resumed_tokens: int = 0) -> AsyncIterator[StreamDelta]:
        # The workers know the call by an id of the router's own, never the client's: a
        # client reusing an id (e.g. right after its deadline, while the workers still clean
        # up the earlier call) must not meet the earlier call's state.
        worker_id = uuid.uuid4().hex
        self._worker_ids.setdefault(request_id, set()).add(worker_id)
        request = WorkerRequest(worker_id, prompt_token_ids, params, priority, num_resumed_tokens)
        stream = self._colocated(request) if self.colocated else self._disaggregated(request)
        try:
            async for delta in stream:
                yield dataclasses.replace(delta, request_id=request_id)
        except WORKER_GONE as e:
            raise WorkerFailed(f"a worker serving {request_id} is gone: {short_error(e)}") from None
        except RayTaskError as e:
            if isinstance(e, ValueError):  # the worker refused the request's input
                raise ValueError(str(e.cause if hasattr(e, "cause") else e)) from None
            raise
        finally:
            ids = self._worker_ids.get(request_id)
            if ids is not None:
                ids.discard(worker_id)
                if not ids:
                    del self._worker_ids[request_id]

    async def _colocated(self, request: WorkerRequest) -> AsyncIterator[StreamDelta]:
        order = self.prefill_router.order(self.colocated, request.prompt_token_ids, request.params.cache_salt)
        if not order:
            raise NoHealthyWorker("no colocated worker is healthy")
        worker = order[0]
        source = self._kv_source(worker, request)
        prediction = predict(self.prefill_router, Role.COLOCATED, worker, request.prompt_token_ids,
                             request.params.cache_salt, source)
        request = dataclasses.replace(request, kv_source=source)
        self.prefill_router.record(worker, request.prompt_token_ids, request.params.cache_salt)
        release = place_colocated(worker, len(request.prompt_token_ids))  # a burst spreads
        try:
            async for delta in self.streams.follow(worker, lambda inbox: worker.handle.generate.remote(request, inbox),
                                                   request, [worker]):
                if delta.token_ids:
                    release()
                    if prediction is not None:  # its first tokens: the prompt's hit is known
                        prediction.reported(delta.num_cached_tokens, self.metrics)
                yield delta
        finally:
            release()

    async def _disaggregated(self, request: WorkerRequest) -> AsyncIterator[StreamDelta]:
        placement = await self._reserve(request)
        decode, prefill = placement.decode, placement.prefill
        clock = asyncio.get_running_loop()
        died: list[BaseException] = []
        failed: list[BaseException] = []
        prefill_s: list[float] = []
        phase = (None if prefill is None else
                 clock.create_task(self._prefill(placement, request, died, failed, prefill_s)))
        holders = [decode] if prefill is None else [decode, prefill]
        first = True
        try:
            async for delta in self.streams.follow(
                    decode, lambda inbox: decode.handle.stream.remote(request.request_id, inbox), request, holders,
                    died, failed):
                if first and delta.token_ids:
                    first = False
                    placement.release_prompt()
                    learn(self.prefill_costs, placement, clock.time(), prefill_s[0] if prefill_s else None)
                yield delta
        finally:
            placement.release_prompt()
            if phase is not None:
                phase.cancel()
            self.admission.room_freed()  # its blocks are freed, or being freed, on the decode worker

    async def _reserve(self, request: WorkerRequest) -> PrefillPlacement:
        """A decode worker with room for the prompt, and where the prompt is prefilled: wait
        in the admission queue for one while it is not too long, then give up (RESOURCE_EXHAUSTED)."""
        clock = asyncio.get_running_loop()
        start = clock.time()
        prompt, salt = request.prompt_token_ids, request.params.cache_salt

        async def try_once() -> PrefillPlacement | None:
            candidates = self.decode_router.order(self.decode, prompt, salt)
            if not candidates:
                raise NoHealthyWorker("no decode worker is healthy")
            prefills = self.prefill_router.order(self.prefill, prompt, salt)
            for worker in candidates:
                placement = place(self.disagg, self.decode_router, self.prefill_router, worker,
                                  prefills[0] if prefills else None, prompt, salt, clock.time())
                call = (worker.handle.prefill_local if placement.is_local else worker.handle.reserve).remote(
                    dataclasses.replace(request, kv_source=self._kv_source(worker, request)))
                try:
                    placement.destination = await self.calls.unless_down(worker, call)
                except BaseException as e:
                    placement.release_prompt()
                    worker.placed(placement.sent, took=False)
                    if isinstance(e, PoolFull):
                        continue
                    if isinstance(e, (asyncio.CancelledError, *WORKER_GONE)):
                        # The worker may still reserve (or have reserved) blocks for it.
                        self._undo_later(worker, call, request.request_id)
                        if not isinstance(e, asyncio.CancelledError):
                            self.mark_unhealthy(worker, e)
                            continue
                    raise
                worker.placed(placement.sent, took=True)
                self.decode_router.record(worker, prompt, salt)
                if placement.prefill is not None:
                    placement.kv_source = self._kv_source(placement.prefill, request)
                    placement.prefix_prediction = predict(self.prefill_router, Role.PREFILL, placement.prefill,
                                                          prompt, salt, placement.kv_source)
                self._count_decision(placement)
                return placement
            return None

        placement = await self.admission.admit(try_once, f"{len(prompt)} prompt tokens")
        if self.metrics is not None:
            self.metrics.queue_time.observe(clock.time() - start)
        return placement

    def _kv_source(self, worker: WorkerState, request: WorkerRequest) -> KVSource | None:
        """Another worker's tier that holds more of the request's prefix than ``worker``, when
        the KV index knows one (router/kv_sources.py): ``worker`` fetches from it."""
        if self.kv_index is None or self.kv_feed is None:
            return None
        return kv_source_for(self.kv_index, self.kv_feed.tier_addresses, worker, request.prompt_token_ids,
                             request.params.cache_salt)

    def _count_decision(self, placement: PrefillPlacement) -> None:
        logger.debug("%s prefill (%s) on %s", placement.choice.where.value, placement.choice.reason,
                     (placement.prefill or placement.decode).instance)
        if self.metrics is not None:
            self.metrics.prefill_decisions.labels(self.metrics.model_name, placement.choice.where.value,
                                                  placement.choice.reason).inc()

    def _undo_later(self, worker: WorkerState, reservation, request_id: str) -> None:
        """A reservation its request no longer waits for: once the worker has made it, abort
        it (a refused or failed reservation holds nothing)."""
        async def undo() -> bool:
            await reservation
            return await worker.handle.abort.remote(request_id)
        self.calls.later(undo(), f"undoing the reservation of {request_id} on {worker.instance}")

    async def _prefill(self, placement: PrefillPlacement, request: WorkerRequest, died: list[BaseException],
                       failed: list[BaseException], prefill_s: list[float]) -> None:
        """Prefill on one worker, then hand the first token to the decode worker. A failure
        goes into `failed` (and a prefill worker that died under it into `died`) before the
        decode worker is told to abort: its abort delta may reach the stream before this task
        has ended. prefill_s gets how long the prefill call took."""
        prefill, decode = placement.prefill, placement.decode
        assert prefill is not None
        self.prefill_router.record(prefill, request.prompt_token_ids, request.params.cache_salt)
        clock = asyncio.get_running_loop()
        worker = prefill
        try:
            start = clock.time()
            first = await self.calls.unless_down(prefill, prefill.handle.prefill.remote(
                dataclasses.replace(request, kv_source=placement.kv_source), placement.destination))
            prefill_s.append(clock.time() - start)
            placement.release_prompt()
            if placement.prefix_prediction is not None:
                placement.prefix_prediction.reported(first.num_cached_tokens, self.metrics)
            worker = decode
            await self.calls.unless_down(decode, decode.handle.start.remote(first))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the decode stream then ends with this request aborted
            logger.warning("prefill of %s failed on %s: %s", request.request_id, worker.instance, short_error(e))
            failed.append(e)
            if isinstance(e, WORKER_GONE):
                # NOTE: only the worker whose call failed is marked down: a decode worker
                # dying as it is handed the first token says nothing about the prefill pool.
                if worker is prefill:
                    died.append(e)
                self.mark_unhealthy(worker, e)
            await self.calls.abort_on([decode], request.request_id)
            raise
