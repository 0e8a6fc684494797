"""What every worker (prefill, decode, colocated) shares: its model, engine, loop and load."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import Any

import torch

from tandem.config import WorkerConfig
from tandem.config.device import resolve_device, resolve_dtype
from tandem.engine.engine import LLMEngine
from tandem.engine.grammars import Grammars
from tandem.engine.hooks import PrefillHooks
from tandem.engine.model_runner import KVAllocator, ModelRunner, private_pool
from tandem.engine.setup import engine_config_and_weights
from tandem.engine.snapshots import EngineInventory
from tandem.engine.step_threads import StepThreads
from tandem.model.dtypes import DTYPES
from tandem.model.fingerprint import model_fingerprint
from tandem.model.generation_defaults import sampling_defaults
from tandem.model.loader import LoadedModel, load_model
from tandem.model.source import resolve_model_source
from tandem.parallel.launch import start_engine_model
from tandem.worker import faults
from tandem.worker.api import EngineDown, Role, TokenizerSpec, WorkerInventory, WorkerLoad, WorkerRequest
from tandem.worker.delta_stream import DeltaStream, Send
from tandem.worker.engine_loop import EngineLoop
from tandem.worker.heartbeat_file import HeartbeatFile
from tandem.worker.kv_events_publisher import KVEventPublisher, events_host
from tandem.worker.metrics import WorkerMetrics
from tandem.worker.prefix_fetch import PrefixFetcher
from tandem.worker.state_table import StateTable
from tandem.worker.tokenizer_spec import tokenizer_spec_from

logger = logging.getLogger(__name__)

ENGINE_DOWN_EXIT_S = 1.0
"""How long a worker whose engine stopped on an error lives on, so that its requests' errors
reach the router, before it ends its process."""


class Worker:
    """An engine over one KV pool, stepped by an EngineLoop. Subclasses add their phase."""

    role: Role
    handoffs: StateTable[Any, Any] | None = None
    """Where each request stands in the handoff (prefill and decode workers; the loop thread's)."""
    exit_on_engine_down = False
    """Whether the process ends when the engine loop stops on an error (set for a Ray actor:
    Ray restarts it, with a fresh engine)."""

    def __init__(self, config: WorkerConfig, instance: str, placement_group: Any = None,
                 allocate_kv: KVAllocator = private_pool, loaded: LoadedModel | None = None) -> None:
        """config.model (at config.revision) is loaded here, unless ``loaded`` (weights already
        in this process: tests) is given, and by the other ranks with tensor_parallel_size > 1,
        which `placement_group`, a Ray placement group with a bundle per rank, places (see
        parallel.ranks.RankGroup). allocate_kv: where the KV pool lives (at tensor_parallel_size 1)."""
        self._fault_injection = config.fault_injection
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)  # pinned: workers sharing a host do not fight
        self.instance = instance
        device = resolve_device(config.device)  # here, in the worker's process: the GPUs Ray gave it
        dtype = resolve_dtype(config.dtype, device)
        source = resolve_model_source(config.model, config.revision)
        self.sampling_defaults = sampling_defaults(source.path, config.generation_config)
        if loaded is None:
            loaded = load_model(source, DTYPES[dtype])
        # NOTE: a prefill worker's prompts take all their blocks at admission: transfers read them
        # while later chunks compute, and a preemption would free them under the transfer.
        engine_args = {**config.engine_args(device, dtype), "reserve_whole_prompts": self.role is Role.PREFILL}
        engine_config, loaded = engine_config_and_weights(loaded, engine_args, source)
        self.fingerprint = model_fingerprint(loaded)
        """The weights' identity, which KV transfer peers must share (the whole model's, on any tp)."""
        started = start_engine_model(loaded, engine_config, config.model, config.num_threads, placement_group,
                                     allocate_kv, config.revision)
        self.ranks = started.ranks
        if started.ranks is not None:  # keep rank 0's part only: the whole model's weights go
            loaded = LoadedModel(loaded.config, started.model.weights, loaded.tokenizer)
        self.loaded = loaded
        self.metrics = WorkerMetrics(self.role, instance, loaded.config.name)
        m = engine_config.model
        self.engine = LLMEngine(
            engine_config, started.model, loaded.tokenizer if self.role is not Role.PREFILL else None,  # no text out
            runner=started.runner, hooks=self._prefill_hooks(started.runner), observer=self.metrics,
            # A prefill worker samples first tokens under structured outputs' grammars all the same.
            grammars=Grammars(loaded.tokenizer, m.vocab_size, m.eos_token_ids),
            # A compiled decode step keeps every thread even on small steps: it yields a core to
            # the serving path as it goes (step_threads.py's reason does not hold), and a lone
            # stream measured 10.1-11.1 ms a token on 2 threads against 14.4-15.1 on 1.
            step_threads=(StepThreads.for_served_worker(torch.get_num_threads())
                          if engine_config.device.type == "cpu" and started.runner.compiled_step is None else None))
        self.loop = self._start_loop()
        self.loop.heartbeat_file = HeartbeatFile.from_env(instance)
        self.kv_events = None if not config.publish_kv_events else KVEventPublisher(
            self.engine, instance, events_host(config.kv_transfer))
        """Publishes the pool's block events (None: not asked for)."""
        # The router points workers at each other's tiers only by its KV index: no events, no server.
        self.prefix_fetch = PrefixFetcher(self.loop, config.kv_transfer, config.publish_kv_events)
        if self.prefix_fetch.disk is not None:
            self.metrics.peer_fetch = self.prefix_fetch.counters
        logger.info("%s worker %s ready on %s, %s, KV cache %s (pid %d, %d torch threads)", self.role.value, instance,
                    engine_config.device_name, engine_config.dtype_name, engine_config.kv_cache_dtype_name, os.getpid(),
                    torch.get_num_threads())

    def _prefill_hooks(self, runner: ModelRunner) -> PrefillHooks | None:
        """What the engine runs inside each step for this role: a prefill worker's KV sends."""
        return None

    def _start_loop(self) -> EngineLoop:
        return EngineLoop(self.engine, on_down=self._engine_down)

    def _engine_down(self, down: EngineDown) -> None:
        """On the loop thread, once the engine stopped on an error (its streams have their
        error): fail whatever else waits on it, then end the process if so set."""
        self._fail_waiting(down)
        if self.exit_on_engine_down:
            logger.error("worker %s: ending its process in %.0f s to be restarted: %s", self.instance,
                         ENGINE_DOWN_EXIT_S, down)
            threading.Timer(ENGINE_DOWN_EXIT_S, os._exit, args=(1,)).start()

    def _fail_waiting(self, down: EngineDown) -> None:
        """The role's own waiters (beside the streams) fail with `down`."""

    async def before_admission(self, request: WorkerRequest) -> None:
        """What a request needs before its admission: its structured-output grammar compiled,
        if it has one, on a thread of its own (a schema takes up to a second: the engine loop
        then finds it cached and never stalls other requests on it; ValueError when the
        constraint cannot compile); then the prefix blocks its kv_source holds and this worker
        lacks, fetched."""
        constraint = request.params.structured_outputs
        if constraint is not None:
            await asyncio.to_thread(self.engine.grammars.compile, constraint)
        await self.prefix_fetch.fetch(request)

    async def send_deltas(self, stream: DeltaStream, send: Send) -> None:
        """Send ``stream``'s deltas to ``send`` until the request's last; leaving early (the
        call cancelled, or ``send`` failed) aborts the request. The stream is closed either way."""
        finished = False
        try:
            await stream.bind(send)
            finished = True
        finally:
            self.loop.close_stream(stream.request_id)
            if not finished:
                await self.abort(stream.request_id)

    async def abort(self, request_id: str) -> bool:
        """Abort a request (its stream gets a last delta saying so) -> whether it was here."""
        return await self.loop.call(lambda engine: self._abort(engine, request_id))

    def _abort(self, engine: LLMEngine, request_id: str) -> bool:
        raise NotImplementedError

    async def inject_fault(self, kind: str) -> None:
        """Break the engine on purpose (faults.FAULTS): only with fault_injection on."""
        if not self._fault_injection:
            raise PermissionError(f"worker {self.instance} was not started with fault_injection")
        await self.loop.call(lambda engine: faults.inject(engine, kind))

    def is_ready(self) -> bool:
        return True

    def tokenizer_spec(self) -> TokenizerSpec:
        return tokenizer_spec_from(self.loaded.tokenizer, self.loaded.config.name, self.loaded.config.vocab_size,
                                   self.engine.config.max_model_len, self.sampling_defaults,
                                   self.engine.config.scheduling_policy)

    async def load(self) -> WorkerLoad:
        return await self.loop.call(self._load)

    def heartbeat(self) -> float:
        """Seconds since the engine loop last went round (answered at once, off the loop)."""
        return self.loop.seconds_since_iteration()

    async def metrics_text(self) -> str:
        """This worker's metrics in Prometheus' text format (read between engine steps)."""
        return await self.loop.call(self.metrics.render)

    async def inventory(self) -> WorkerInventory:
        """What this worker holds for requests (tests: every exit path leaves it empty)."""
        return await self.loop.call(self._inventory)

    async def handoff_trace(self) -> list[tuple[str, str, str]]:
        """The latest moves of this worker's handoff table, oldest first: (request id, from
        state, to state) by name; a request enters as (id, initial, initial). [] for a worker
        with no handoff (colocated)."""
        table = self.handoffs
        if table is None:
            return []
        return await self.loop.call(lambda engine: [(rid, a.name, b.name) for rid, a, b in table.trace])

    def _inventory(self, engine: LLMEngine) -> WorkerInventory:
        inventory = engine.inventory()
        return WorkerInventory(
            role=self.role, instance=self.instance, num_waiting=inventory.num_waiting,
            num_running=inventory.num_running, num_sequences=inventory.num_requests,
            num_open_streams=self.loop.num_streams, num_blocks=inventory.num_blocks,
            num_free_blocks=inventory.num_free_blocks, num_referenced_blocks=inventory.num_referenced_blocks,
            num_swapped_blocks=inventory.num_swapped_blocks, **self._held(inventory),
        )

    def _held(self, inventory: EngineInventory) -> dict[str, int]:
        """The role's own WorkerInventory fields (on the loop thread), beside what its engine holds."""
        return {}

    def _load(self, engine: LLMEngine) -> WorkerLoad:
        load, m = engine.load(), self.metrics
        return WorkerLoad(
            role=self.role, instance=self.instance, num_blocks=load.num_blocks, num_free_blocks=load.num_free_blocks,
            num_running=load.num_running, num_waiting=load.num_waiting, num_queued_tokens=load.num_queued_tokens,
            block_size=engine.config.block_size, num_prompt_tokens=m.num_prefix_queries - m.num_prefix_hits,
            num_generated_tokens=m.num_generated_tokens, num_prefix_queries=m.num_prefix_queries,
            num_prefix_hits=m.num_prefix_hits,
        )

    def kv_tier_address(self) -> str | None:
        """Where other workers fetch prefix blocks from this worker's pool and disk tier (None: nowhere)."""
        return self.prefix_fetch.address

    def kv_disk_share_id(self) -> str | None:
        """The id of the folder this worker's disk tier keeps its files in, the same for every
        worker reading them (DiskTier.share_id; None: no disk tier)."""
        return None if self.prefix_fetch.disk is None else self.prefix_fetch.disk.share_id

    def kv_events_address(self) -> str | None:
        """Where this worker publishes its KV block events (None: it does not)."""
        return None if self.kv_events is None else self.kv_events.address

    async def kv_snapshot(self) -> dict | None:
        """The blocks this worker holds, for the router's index after a lost batch (see
        KVEventPublisher.snapshot); None: no events published."""
        publisher = self.kv_events
        return None if publisher is None else await self.loop.call(publisher.snapshot)

    def shutdown(self) -> None:
        if self.kv_events is not None:
            self.kv_events.close()
        self.prefix_fetch.close()
        self.loop.stop()
        if self.ranks is not None:
            self.ranks.stop()
