"""The router on the virtual clock: its real Router orderings, WorkerState views, prefill
decision (router/prefill_placement.py over router/disagg.py) and cost learning, driven by
callbacks instead of asyncio and Ray.

What is reproduced rather than imported, because the real code awaits actor calls:
- RayBackend's request phases (router/ray_backend.py): colocated: order, record, generate;
  disaggregated: admission (try each ordered decode worker: place, then reserve or
  prefill_local; PoolFull tries the next), then for a remote prefill the prefill call, the
  first token handed to the decode worker (start), the KV's arrival; room_freed at each end.
- AdmissionQueue (router/admission.py): see SimAdmission.
- WorkerHealth's load poll (router/worker_health.py): every worker's load, answered
  between its steps, at most LOAD_TIMEOUT_S late, a round every LOAD_POLL_S after the last;
  a decode worker whose free blocks rose frees room. Workers never fail here.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
from dataclasses import dataclass, field
from typing import Callable

from tandem.engine.engine import LLMEngine
from tandem.engine.sequence import Sequence
from tandem.outputs import RequestDelta
from tandem.router.backend import NoHealthyWorker
from tandem.router.disagg import PrefillCosts, make_disagg_policy
from tandem.router.policy import Router, WorkerState
from tandem.router.prefill_placement import PrefillPlacement, learn, place, place_colocated
from tandem.router.worker_health import LOAD_POLL_S, LOAD_TIMEOUT_S
from tandem.sampling_params import SamplingParams
from tandem.sim.admission_sim import SimAdmission
from tandem.sim.cluster import SimCluster, SimWorker, transfer_done_s
from tandem.sim.spec import ClusterSpec, SimRequest
from tandem.worker.api import PoolFull

logger = logging.getLogger(__name__)

@dataclass
class SimTrace:
    """One request's way through the simulated cluster (virtual seconds from the run's start)."""

    index: int
    request: SimRequest
    arrive_s: float
    """At the router (its send time plus the router's overhead)."""
    admitted_s: float | None = None
    where: str = ""
    """"colocated", or the prefill decision's "local" or "remote"."""
    reason: str = ""
    prefill_start_s: float | None = None
    prefill_end_s: float | None = None
    """A remote prefill's first token, on the prefill worker."""
    kv_done_s: float | None = None
    first_token_s: float | None = None
    chunk_s: list[float] = field(default_factory=list)
    """When each non-empty delta reached the router."""
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    end_s: float | None = None
    finish_reason: str | None = None
    code: str | None = None
    error: str | None = None

    @property
    def request_id(self) -> str:
        return f"sim-{self.index}"

    @property
    def prompt(self) -> list[int]:
        return list(self.request.prompt_token_ids)

    @property
    def params(self) -> SamplingParams:
        """As the bench sends: greedy, EOS ignored, exactly output_len tokens."""
        return SamplingParams(temperature=0.0, max_tokens=self.request.output_len, ignore_eos=True)


class SimRouter:
    """RayBackend's control plane over a SimCluster."""

    def __init__(self, cluster: SimCluster, spec: ClusterSpec, kv_bytes_per_token: int, num_layers: int,
                 num_requests: int, on_end: Callable[[SimTrace], None]) -> None:
        """num_requests: how many will be submitted (the load poll runs until all have ended);
        on_end: called with each request's trace as it ends."""
        self.cluster, self.spec, self.clock = cluster, spec, cluster.clock
        self.kv_bytes_per_token, self.num_layers = kv_bytes_per_token, num_layers
        self.on_end = on_end
        self.prefill_router = Router(spec.routing_policy)
        self.decode_router = Router(spec.routing_policy, for_decode=True)
        self.costs = PrefillCosts()
        self.disagg = make_disagg_policy(spec.disagg_policy, self.costs, spec.max_local_stall_s)
        self.admission = SimAdmission(self.clock)
        self.decisions: collections.Counter[tuple[str, str]] = collections.Counter()
        self.num_unfinished = num_requests
        """Requests not ended yet: the load poll runs while there are any."""

    # -- the load poll -----------------------------------------------------------------------
    def start_polling(self) -> None:
        """The first round now, as WorkerHealth.start does."""
        self._poll_round()

    def _poll_round(self) -> None:
        if self.num_unfinished <= 0:
            return
        workers = self.cluster.workers
        start, left = self.clock.now, {w.instance for w in workers}

        def settle(w: SimWorker) -> None:
            left.discard(w.instance)
            if not left:
                self.clock.after(LOAD_POLL_S, self._poll_round)

        def timed_out() -> None:
            for w in [w for w in workers if w.instance in left]:
                settle(w)  # left for the next poll (a step longer than the timeout)

        def answer(w: SimWorker, poll: int) -> None:
            if w.instance not in left:
                return
            load = w.load()
            last = w.state.load
            if w in self.cluster.decode and (last is None or load.num_free_blocks > last.num_free_blocks):
                self.admission.room_freed()
            w.state.load_reported(load, poll)
            settle(w)

        timer = self.clock.at(start + LOAD_TIMEOUT_S, timed_out)
        for w in workers:
            poll = w.state.begin_poll()
            w.call(functools.partial(answer, w, poll))
        if not left:
            timer.cancel()

    # -- requests ----------------------------------------------------------------------------
    def submit(self, index: int, request: SimRequest) -> None:
        """The request reaches the router now."""
        t = SimTrace(index, request, self.clock.now)
        if self.cluster.colocated:
            self._colocated(t)
        else:
            self.admission.admit(lambda answer: self._try_once(t, answer), lambda result: self._admitted(t, result))

    def _colocated(self, t: SimTrace) -> None:
        workers = self.prefill_router.order([w.state for w in self.cluster.colocated], t.prompt)
        worker: SimWorker = workers[0].handle
        self.prefill_router.record(workers[0], t.prompt)
        release = place_colocated(workers[0], len(t.prompt))
        t.admitted_s, t.where = self.clock.now, "colocated"

        def on_delta(d: RequestDelta) -> None:
            if d.new_token_ids or d.request_finished:
                release()
            self._delta(t, d, None)

        def generate() -> None:
            try:
                worker.add(t.request_id, t.prompt, t.params, on_delta)
            except ValueError as e:
                release()
                self._fail(t, "INVALID_ARGUMENT", str(e))
        worker.call(generate)

    def _try_once(self, t: SimTrace, answer: Callable[[object], None]) -> None:
        candidates = self.decode_router.order([w.state for w in self.cluster.decode], t.prompt)
        prefills = self.prefill_router.order([w.state for w in self.cluster.prefill], t.prompt)
        self._try_candidate(t, candidates, prefills[0] if prefills else None, answer)

    def _try_candidate(self, t: SimTrace, candidates: list[WorkerState], prefill: WorkerState | None,
                       answer: Callable[[object], None]) -> None:
        if not candidates:
            answer(None)
            return
        state, worker = candidates[0], candidates[0].handle
        try:
            placement = place(self.disagg, self.decode_router, self.prefill_router, state, prefill, t.prompt, None,
                              self.clock.now)
        except NoHealthyWorker as e:  # as the real try_once: the request ends, its turn with it
            answer(e)
            return

        def on_worker() -> None:
            listener = lambda d: self._delta(t, d, placement)  # noqa: E731
            try:
                if placement.is_local:
                    worker.prefill_local(t.request_id, t.prompt, t.params, listener)
                else:
                    placement.destination = worker.reserve(t.request_id, t.prompt, t.params, listener)
            except (PoolFull, ValueError) as e:
                placement.release_prompt()
                state.placed(placement.sent, took=False)
                if isinstance(e, PoolFull):
                    self._try_candidate(t, candidates[1:], prefill, answer)
                else:
                    answer(e)
                return
            state.placed(placement.sent, took=True)
            self.decode_router.record(state, t.prompt)
            self.decisions[(placement.choice.where.value, placement.choice.reason)] += 1
            answer(placement)
        worker.call(on_worker)

    def _admitted(self, t: SimTrace, result: object) -> None:
        if isinstance(result, BaseException):
            code = ("INVALID_ARGUMENT" if isinstance(result, ValueError) else
                    "UNAVAILABLE" if isinstance(result, NoHealthyWorker) else "RESOURCE_EXHAUSTED")
            self._fail(t, code, str(result))
            return
        assert isinstance(result, PrefillPlacement)
        t.admitted_s = self.clock.now
        t.where, t.reason = result.choice.where.value, result.choice.reason
        if not result.is_local:
            self._remote_prefill(t, result)

    def _remote_prefill(self, t: SimTrace, placement: PrefillPlacement) -> None:
        """RayBackend._prefill and the prefill worker's side: the prompt with max_tokens=1 and
        its blocks kept; its first token to the decode worker; its KV there at transfer_done_s."""
        assert placement.prefill is not None  # a remote prefill's
        prefill: SimWorker = placement.prefill.handle
        decode: SimWorker = placement.decode.handle
        self.prefill_router.record(placement.prefill, t.prompt)
        t.prefill_start_s = self.clock.now
        seqs: list[Sequence] = []

        def on_first(d: RequestDelta) -> None:
            now = t.prefill_end_s = self.clock.now
            placement.release_prompt()
            first = LLMEngine.first_sample(seqs[0])
            assert first is not None  # the step that called on_first drew it
            chunks = prefill.observer.chunks.pop(t.request_id)
            done = transfer_done_s(chunks, now, len(t.prompt) - placement.destination, self.kv_bytes_per_token,
                                   self.num_layers, self.spec.link_bytes_per_s, self.spec.link_latency_s)
            decode.call(lambda: decode.start(t.request_id, first))
            self.clock.at(done, lambda: self._kv_arrived(t, prefill, decode, seqs[0]))

        def admit() -> None:
            try:
                seqs.append(prefill.add(t.request_id, t.prompt, dataclasses.replace(t.params, max_tokens=1), on_first,
                                        keep_blocks=True))
            except ValueError as e:  # its pool could never hold the prompt: the decode worker lets go
                decode.call(lambda: decode.engine.abort_request(t.request_id))
                placement.release_prompt()
                self._fail(t, "INVALID_ARGUMENT", str(e))
        prefill.call(admit)

    def _kv_arrived(self, t: SimTrace, prefill: SimWorker, decode: SimWorker, seq: Sequence) -> None:
        t.kv_done_s = self.clock.now
        decode.call(lambda: decode.kv_arrived(t.request_id))
        prefill.call(lambda: prefill.engine.release_blocks(seq))  # the sender's ack frees them

    def _delta(self, t: SimTrace, d: RequestDelta, placement: PrefillPlacement | None) -> None:
        """A delta of the request's stream reaches the router (RayBackend._disaggregated's loop)."""
        now = self.clock.now
        if d.new_token_ids:
            if t.first_token_s is None:
                t.first_token_s, t.num_cached_tokens = now, d.num_cached_tokens
                if placement is not None:
                    placement.release_prompt()
                    learn(self.costs, placement, now,
                          None if t.prefill_end_s is None or t.prefill_start_s is None
                          else t.prefill_end_s - t.prefill_start_s)
            t.chunk_s.append(now)
            t.num_output_tokens += len(d.new_token_ids)
        if d.request_finished:
            if placement is not None:
                placement.release_prompt()
                self.admission.room_freed()  # its blocks are freed on the decode worker
            t.finish_reason = None if d.finish_reason is None else d.finish_reason.value
            t.code = "OK"
            self._end(t)

    def _fail(self, t: SimTrace, code: str, error: str) -> None:
        t.code, t.error = code, f"{code}: {error}"
        self._end(t)

    def _end(self, t: SimTrace) -> None:
        t.end_s = self.clock.now
        self.num_unfinished -= 1
        self.on_end(t)
