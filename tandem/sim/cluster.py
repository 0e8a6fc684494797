"""The simulated cluster: a virtual clock, and workers that are real LLMEngines over a
SimRunner, stepped as a worker's EngineLoop steps them.

What each worker does here mirrors its real class (read beside them):
- every worker (tandem/worker/engine_loop.py): commands from the router run between steps,
  in the order they came; the engine steps while it has work; a step takes the step-time
  model's seconds and its deltas go out at its end.
- prefill (prefill_node/worker.py): ``prefill`` queues the prompt with max_tokens=1 and its
  blocks kept; the blocks go once the KV has reached the decode worker.
- decode (decode_node/worker.py): ``reserve`` holds blocks (reserve_prefilled); ``start``
  takes the prefill worker's first token (streamed at once, the KV may still be on its
  way: accept_first_sample); ``kv_arrived`` joins it to the batch (start_prefilled).
  ``prefill_local`` queues the whole prompt on this engine (a local prefill).
- colocated (tandem/worker/colocated.py): ``generate`` queues the request.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from dataclasses import dataclass, field
from typing import Callable

from tandem.config import EngineConfig, ModelConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.scheduler import ScheduledBatch
from tandem.engine.sequence import Sequence
from tandem.outputs import FirstSample, RequestDelta
from tandem.router.policy import WorkerState
from tandem.sampling_params import SamplingParams
from tandem.sim.sim_runner import SimRunner
from tandem.sim.spec import PoolSpec, StepTimeModel
from tandem.worker.api import PoolFull, Role, WorkerLoad

logger = logging.getLogger(__name__)


class Timer:
    """A scheduled call that may be called off."""

    __slots__ = ("cancelled",)

    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Clock:
    """Virtual time: a heap of (time, order, timer, fn); ``run`` calls them in time order,
    ties in the order they were scheduled."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Timer, Callable[[], None]]] = []
        self._order = itertools.count()
        self.num_events = 0

    def at(self, t: float, fn: Callable[[], None]) -> Timer:
        timer = Timer()
        heapq.heappush(self._heap, (max(t, self.now), next(self._order), timer, fn))
        return timer

    def after(self, dt: float, fn: Callable[[], None]) -> Timer:
        return self.at(self.now + dt, fn)

    def run(self, until: float = float("inf")) -> None:
        """Until nothing is scheduled, or the next call is after ``until``."""
        while self._heap:
            t, _, timer, fn = heapq.heappop(self._heap)
            if timer.cancelled:
                continue
            if t > until:
                return
            self.now = t
            self.num_events += 1
            fn()


def engine_config(pool: PoolSpec, model: ModelConfig, dtype: str = "float32") -> EngineConfig:
    """A worker's EngineConfig as ``tandem serve`` builds it (EngineConfig.build with the engine
    options' defaults), the pool's sizes given. device cpu: no device is asked about, and
    the sim's runner has no tensors."""
    return EngineConfig.build(model, device="cpu", dtype=dtype, block_size=pool.block_size,
                              num_kv_blocks=pool.num_kv_blocks, max_num_seqs=pool.max_num_seqs,
                              max_num_batched_tokens=pool.max_num_batched_tokens, tensor_parallel_size=pool.tp)


@dataclass
class ChunkLog:
    """A prefill worker's record of one prompt's chunks (for its KV transfer's timing)."""

    first_start_s: float
    last_tokens: int = 0


class _Observer:
    """The engine's observer: when each prompt's chunks ran (LLMEngine calls on_step just
    before the runner, at the step's start in virtual time)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.chunks: dict[str, ChunkLog] = {}

    def on_step(self, batch: ScheduledBatch) -> None:
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.num_output_tokens == 0:  # a prompt chunk (prefill workers' sequences never decode)
                log = self.chunks.setdefault(seq.request_id, ChunkLog(self.clock.now))
                log.last_tokens = n

    def on_first_token(self, seq: Sequence) -> None:
        pass

    def on_finished(self, seq: Sequence) -> None:
        pass


class SimWorker:
    """One worker: an LLMEngine (model=None, a SimRunner) on the shared clock."""

    def __init__(self, role: Role, instance: str, config: EngineConfig, step_model: StepTimeModel,
                 clock: Clock) -> None:
        self.role = role
        self.clock = clock
        self.runner = SimRunner(step_model, config.tensor_parallel_size)
        self.observer = _Observer(clock)
        """When each prompt's chunks ran (a prefill worker's only: its transfers' timing)."""
        observer = self.observer if role is Role.PREFILL else None
        self.engine = LLMEngine(config, None, None, observer=observer, runner=self.runner)  # type: ignore[arg-type]
        self.state = WorkerState(instance, handle=self)
        """The router's view of this worker (its policies' real WorkerState)."""
        self.listeners: dict[str, Callable[[RequestDelta], None]] = {}
        """Request id -> who reads its deltas (the router's side of the stream)."""
        self._pending: list[Callable[[], object]] = []
        self._stepping = False
        self._kick: Timer | None = None
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0
        self.num_generated_tokens = 0
        # The decode worker's bookkeeping (DecodeWorker's sets, for n = 1 requests).
        self._arrived: set[str] = set()
        self._first_tokens: dict[str, FirstSample] = {}
        self._streamed_first: set[str] = set()
        self._finished_first: dict[str, Sequence] = {}

    @property
    def instance(self) -> str:
        return self.state.instance

    # -- the engine loop -----------------------------------------------------------------
    def call(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` on this worker between steps (at once when it is idle)."""
        if self._stepping:
            self._pending.append(fn)
            return
        fn()
        self._wake()

    def _wake(self) -> None:
        """Step at this instant, once every command that came at it has run."""
        if not self._stepping and self._kick is None and self.engine.has_unfinished:
            self._kick = self.clock.at(self.clock.now, self._step)

    def _step(self) -> None:
        if self._kick is not None:
            self._kick.cancel()
            self._kick = None
        if self._stepping:
            return
        num_steps = self.runner.num_steps
        deltas = self.engine.step()
        if self.runner.num_steps == num_steps:
            return  # nothing could run (out of blocks or seqs): idle until a command comes
        self._stepping = True
        self.clock.after(self.runner.last_step_s, lambda: self._step_end(deltas))

    def _step_end(self, deltas: list[RequestDelta]) -> None:
        # NOTE: as EngineLoop._loop: the commands already queued run between this step and the
        # next; those the deltas cause (the router answers them) come after the next step.
        queued, self._pending = self._pending, []
        for d in deltas:
            self._publish(d)
        for fn in queued:
            fn()
        self._stepping = False
        if self.engine.has_unfinished:
            self._step()
        if not self._stepping:  # idle (or nothing could run): what came meanwhile runs now
            queued, self._pending = self._pending, []
            for fn in queued:
                fn()
            self._wake()

    def _publish(self, d: RequestDelta) -> None:
        self.num_generated_tokens += len(d.new_token_ids)
        if d.new_token_ids and d.num_output_tokens == len(d.new_token_ids):  # the first: the prompt is done
            self.num_prefix_queries += d.num_prompt_tokens
            self.num_prefix_hits += d.num_cached_tokens
        listener = self.listeners.get(d.request_id)
        if d.request_finished:
            self.listeners.pop(d.request_id, None)
        if listener is not None:
            listener(d)

    def load(self) -> WorkerLoad:
        """What its load() answers (tandem/worker/base.py: Worker._load)."""
        load = self.engine.load()
        return WorkerLoad(role=self.role, instance=self.instance, num_blocks=load.num_blocks,
                          num_free_blocks=load.num_free_blocks, num_running=load.num_running,
                          num_waiting=load.num_waiting, num_queued_tokens=load.num_queued_tokens,
                          block_size=self.engine.config.block_size,
                          num_prompt_tokens=self.num_prefix_queries - self.num_prefix_hits,
                          num_generated_tokens=self.num_generated_tokens,
                          num_prefix_queries=self.num_prefix_queries, num_prefix_hits=self.num_prefix_hits)

    # -- what the router calls (each inside a `call`) --------------------------------------
    def add(self, request_id: str, prompt: list[int], params: SamplingParams,
            listener: Callable[[RequestDelta], None], keep_blocks: bool = False) -> Sequence:
        """Queue a request (colocated generate, a local prefill, a prefill worker's prompt)."""
        seq = self.engine.add_request(request_id, prompt, params, keep_blocks=keep_blocks)
        self.listeners[request_id] = listener
        return seq

    def prefill_local(self, request_id: str, prompt: list[int], params: SamplingParams,
                      listener: Callable[[RequestDelta], None]) -> None:
        """Decode: prefill the prompt here (DecodeWorker._prefill_local): PoolFull unless the
        pool has room for it now (LLMEngine.may_add_request)."""
        if not self.engine.may_add_request(prompt, params):
            raise PoolFull(f"{self.instance}: no room for {len(prompt)} prompt tokens now")
        self.add(request_id, prompt, params, listener)

    def reserve(self, request_id: str, prompt: list[int], params: SamplingParams,
                listener: Callable[[RequestDelta], None]) -> int:
        """Decode: hold blocks for a prompt prefilled elsewhere -> its tokens this pool
        caches already (not sent). PoolFull when it has no room now."""
        if self.engine.reserve_prefilled(request_id, prompt, params) is None:
            raise PoolFull(f"{self.instance}: no room for {len(prompt)} prompt tokens now")
        self.listeners[request_id] = listener
        seq = self.engine.get_sequence(request_id)
        assert seq is not None  # reserve_prefilled added it
        return seq.num_cached_prompt_tokens

    def start(self, request_id: str, first: FirstSample) -> None:
        """Decode: the prefill worker's first token (DecodeWorker._start, n = 1)."""
        seq = self.engine.get_sequence(request_id)
        if seq is None:
            return
        if request_id in self._arrived or not self.engine.may_accept_first_sample(seq):
            self._first_tokens[request_id] = first
            self._start_if_ready(request_id)
            return
        for d in self.engine.accept_first_sample(request_id, first):
            self._publish(d)
        if seq.status.is_finished:
            self._finished_first[request_id] = seq
        else:
            self._streamed_first.add(request_id)

    def kv_arrived(self, request_id: str) -> None:
        """Decode: the receiver's DONE for the request (DecodeWorker._tick)."""
        finished = self._finished_first.pop(request_id, None)
        if finished is not None:
            self.engine.release_blocks(finished)
        elif request_id in self._streamed_first:
            self._streamed_first.discard(request_id)
            self.engine.start_prefilled(request_id)
        elif self.engine.get_sequence(request_id) is not None:
            self._arrived.add(request_id)
            self._start_if_ready(request_id)

    def _start_if_ready(self, request_id: str) -> None:
        if request_id not in self._arrived or request_id not in self._first_tokens:
            return
        self._arrived.discard(request_id)
        for d in self.engine.start_prefilled(request_id, self._first_tokens.pop(request_id)):
            self._publish(d)


@dataclass
class SimCluster:
    """The workers of a ClusterSpec's pools, on one clock."""

    clock: Clock
    prefill: list[SimWorker] = field(default_factory=list)
    decode: list[SimWorker] = field(default_factory=list)
    colocated: list[SimWorker] = field(default_factory=list)

    @property
    def workers(self) -> list[SimWorker]:
        return self.prefill + self.decode + self.colocated

    @classmethod
    def build(cls, pools: dict[Role, PoolSpec], model: ModelConfig, step_model: StepTimeModel,
              dtype: str = "float32") -> SimCluster:
        """pools: the spec of each role in use (colocated, or prefill and decode)."""
        cluster = cls(Clock())
        for role, pool in pools.items():
            config = engine_config(pool, model, dtype)
            workers = [SimWorker(role, f"{role.value}-{i}", config, step_model, cluster.clock)
                       for i in range(pool.num_workers)]
            getattr(cluster, role.value).extend(workers)
        return cluster


def transfer_done_s(chunks: ChunkLog, prefill_end_s: float, num_tokens: int, kv_bytes_per_token: int,
                    num_layers: int, link_bytes_per_s: float, link_latency_s: float) -> float:
    """When the last of ``num_tokens`` tokens' KV is in the decode worker's pool.

    The real transfer streams each layer as the forward stores it (prefill_node/worker.py:
    _send_layer), so it overlaps the prefill: it ends no sooner than the prefill's last
    layer is sent (the prefill's end plus one layer of the last chunk on the link), and no
    sooner than all its bytes take on the link from the first chunk's start; then the
    link's latency. NOTE: each transfer has the link to itself (concurrent transfers do
    not share its bandwidth)."""
    num_bytes = num_tokens * kv_bytes_per_token
    last_layer_bytes = min(chunks.last_tokens, num_tokens) * kv_bytes_per_token / max(1, num_layers)
    return max(prefill_end_s + last_layer_bytes / link_bytes_per_s,
               chunks.first_start_s + num_bytes / link_bytes_per_s) + link_latency_s
