"""The decode worker: reserves blocks for a prompt prefilled elsewhere, receives its KV,
then decodes it in its continuous batch and streams the tokens. A prompt the router finds
not worth a remote prefill it runs itself (`prefill_local`), as a colocated worker does.

A request's life here (the whole way: docs/architecture.md):
1. reserved: `reserve` holds blocks for the prompt and the first step (a prefix this pool
   caches is shared, not sent) and tells the KV receiver to expect the rest.
2. first token (`start`, from the prefill worker through the router, as soon as it is
   sampled): streamed at once, while the KV is still arriving (for n > 1 and beam search
   only once the KV is in: they fork the prompt's blocks).
3. KV arrived (the receiver's DONE event, read in `_tick`): with the first token too, the
   sequence joins the running batch; the engine loop steps it.
4. streamed: each step's tokens go out through `stream`, until the last delta.
Exits: a finish frees the blocks in the scheduler (a first token that ends the request
frees them once the transfer has ended). `abort` (cancel, deadline, the prefill worker
gone, a reader that leaves early) first stops the receiver writing, then frees them. KV
that fails or times out aborts the request with an error delta. A dead worker's pool dies
with its process.
"""

from __future__ import annotations

import logging
from typing import Any, AsyncIterator

import torch

from tandem.decoding.beam_search import num_candidates
from tandem.engine.engine import LLMEngine
from tandem.engine.model_runner import private_pool
from tandem.engine.sequence import Sequence
from tandem.engine.snapshots import EngineInventory
from tandem.kvtransfer.cuda_ipc import DevicePoolExport
from tandem.kvtransfer.curve import CurveKeys
from tandem.kvtransfer.handshake import SharedPool
from tandem.kvtransfer.payload import layout_for
from tandem.kvtransfer.placement import host_identity
from tandem.kvtransfer.protocol import Destination, TransferStatus
from tandem.kvtransfer.receiver import DEFAULT_ADDRESS, KVReceiver
from tandem.kvtransfer.shared_pool import SHM_DIR, HostSharedPool
from tandem.outputs import FirstSample
from tandem.parallel.runner import TensorParallelRunner
from tandem.worker.api import PoolFull, PrefillResult, Role, StreamDelta, WorkerRequest, checked
from tandem.worker.base import Worker
from tandem.worker.engine_loop import EngineLoop

logger = logging.getLogger(__name__)


class DecodeWorker(Worker):
    role = Role.DECODE

    def __init__(self, instance: str = "decode-0", transfer_address: str = DEFAULT_ADDRESS,
                 transfer_timeout_s: float = 30.0, node_id: str | None = None, kv_shm_dir: str | None = SHM_DIR,
                 kv_transport: str = "auto", kv_allow_unencrypted_pairs: bool = False, **kwargs: Any) -> None:
        """transfer_timeout_s: how long a reservation waits for the rest of its KV after the
        latest layer message (a prompt queued on the prefill worker has no deadline here: the
        router ends its reservation on every exit path).
        node_id: this worker's node (Ray's node id under Ray; default: the host's identity).
        kv_shm_dir: where the KV pool's file goes, so that prefill workers of this node write
        the KV straight into it (None, or no room there: a private pool, KV by socket only).
        kv_transport: the prefill workers' (kvtransfer.protocol.KV_TRANSPORTS): only auto
        writes into a pool in host shared memory, so the others need none; a pool on a GPU
        is exported by CUDA IPC to a sender on the same GPU unless zmq (two pools on one GPU
        never pair: path_choice.py). The receiver takes any path a sender asks for that its
        pool allows (torch.distributed pairs: dist_pairs.py).
        kv_allow_unencrypted_pairs: with TANDEM_KV_SECRET set, torch.distributed pairs are
        taken all the same (--kv-allow-unencrypted-pairs); else refused."""
        self._kv_allow_unencrypted_pairs = kv_allow_unencrypted_pairs
        if kv_transport == "zmq":
            kv_shm_dir = None
        self._transfer_address = transfer_address
        self._transfer_timeout_s = transfer_timeout_s
        self._node_id = node_id
        self._shared_pool: SharedPool | None = None
        """The KV pool offered to same-node senders (tensor_parallel_size 1): its file in
        shared memory, or, on a GPU, its CUDA IPC export."""

        def allocate_kv(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            if device.type == "cuda":  # the pool stays on its GPU; its grant table goes to kv_shm_dir
                pool = private_pool(shape, dtype, device)
                self._shared_pool = (None if kv_shm_dir is None else DevicePoolExport.create(
                    pool, layout_for(shape, dtype), node_id or host_identity(), kv_shm_dir))
                return pool
            host = None if kv_transport != "auto" or kv_shm_dir is None else HostSharedPool.create(shape, dtype, kv_shm_dir)
            self._shared_pool = host
            return private_pool(shape, dtype, device) if host is None else host.kv_cache

        self._arrived: set[str] = set()
        """Requests whose KV is in their blocks, waiting for their first token."""
        self._first_tokens: dict[str, PrefillResult] = {}
        """First tokens that came before their KV and wait for it (n > 1, beam search)."""
        self._streamed_first: set[str] = set()
        """Requests whose first token went out before their KV arrived, still going."""
        self._finished_first: dict[str, Sequence] = {}
        """Requests that their first token ended before their KV arrived: their blocks are
        freed when the transfer ends."""
        self._readers: set[str] = set()
        """Requests whose stream is being read (on the actor's event loop)."""
        super().__init__(instance, allocate_kv=allocate_kv, **kwargs)

    def _start_loop(self) -> EngineLoop:
        runner = self.engine.runner
        # Tensor-parallel: arriving KV waits on the first rank for the next step, which
        # carries it to every rank (see parallel.kv_writes).
        sink = runner.kv_writes if isinstance(runner, TensorParallelRunner) else None
        self.receiver = KVReceiver(runner.kv_cache, self._transfer_address, self._transfer_timeout_s,
                                   model=self.fingerprint, sink=sink, shared_pool=self._shared_pool,
                                   node_id=self._node_id, curve=CurveKeys.from_env(),
                                   allow_unencrypted_pairs=self._kv_allow_unencrypted_pairs)
        self.metrics.kv_bytes["received"] = lambda: self.receiver.num_bytes_received
        self.metrics.kv_dropped = lambda: dict(self.receiver.dropped)
        self.metrics.num_transferring = lambda: self.receiver.num_pending
        return EngineLoop(self.engine, tick=self._tick, on_down=self._engine_down)

    def _held(self, inventory: EngineInventory) -> dict[str, int]:
        return dict(num_reserved=inventory.num_reserved,
                    num_first_tokens=len(self._first_tokens) + len(self._streamed_first) + len(self._finished_first),
                    num_arrived=len(self._arrived), num_pending_transfers=self.receiver.num_pending)

    async def reserve(self, request: WorkerRequest) -> Destination:
        """Hold blocks for the request's prompt and wait for its KV. Raises PoolFull when the
        pool cannot hold it now; call `stream` next to read its output."""
        request = checked(request, WorkerRequest, "request")
        self.loop.open_stream(request.request_id)
        try:
            await self.compile_grammar(request)
            return await self.loop.call(lambda engine: self._reserve(engine, request))
        except BaseException:
            self.loop.close_stream(request.request_id)
            raise

    async def prefill_local(self, request: WorkerRequest) -> None:
        """Run the request's prompt here, chunked inside this worker's steps as a colocated
        worker does (the router found a remote prefill not worth it: router/disagg.py).
        Raises PoolFull when the pool has no room for it now; call `stream` next."""
        request = checked(request, WorkerRequest, "request")
        self.loop.open_stream(request.request_id)
        try:
            await self.compile_grammar(request)
            await self.loop.call(lambda engine: self._prefill_local(engine, request))
        except BaseException:
            self.loop.close_stream(request.request_id)
            raise

    async def start(self, first: PrefillResult) -> None:
        """The prefill worker's first token: decoding starts once the KV has arrived too."""
        first = checked(first, PrefillResult, "first")
        await self.loop.call(lambda engine: self._start(engine, first))

    async def stream(self, request_id: str) -> AsyncIterator[StreamDelta]:
        """The request's deltas until its last; leaving early aborts it."""
        try:
            q = self.loop.stream_queue(request_id)
        except KeyError:  # aborted before its reader came
            yield StreamDelta(request_id, [], "", "abort", 0, 0)
            return
        self._readers.add(request_id)
        finished = False
        try:
            while not finished:
                delta = await q.get()
                finished = delta.request_finished
                yield delta
        finally:
            self._readers.discard(request_id)
            self.loop.close_stream(request_id)
            if not finished:
                await self.abort(request_id)

    async def abort(self, request_id: str) -> bool:
        aborted = await self.loop.call(lambda engine: self._abort(engine, request_id))
        if request_id not in self._readers:  # reserved, but nobody came (or will come) to read it
            self.loop.close_stream(request_id)
        return aborted

    # -- on the loop thread -------------------------------------------------------------
    def _reserve(self, engine: LLMEngine, request: WorkerRequest) -> Destination:
        block_ids = engine.reserve_prefilled(request.request_id, request.prompt_token_ids, request.params)
        if block_ids is None:
            raise PoolFull(f"{self.instance}: no room for {len(request.prompt_token_ids)} prompt tokens now")
        # Only the KV after the prefix this pool caches already is sent.
        num_cached = engine.get_sequence(request.request_id).num_cached_prompt_tokens
        return self.receiver.expect(request.request_id, block_ids, len(request.prompt_token_ids),
                                    num_cached_tokens=num_cached)

    def _prefill_local(self, engine: LLMEngine, request: WorkerRequest) -> None:
        if not engine.may_add_request(request.prompt_token_ids, request.params):
            raise PoolFull(f"{self.instance}: no room for {len(request.prompt_token_ids)} prompt tokens now")
        engine.add_request(request.request_id, request.prompt_token_ids, request.params)

    def _start(self, engine: LLMEngine, first: PrefillResult) -> None:
        seq = engine.get_sequence(first.request_id)
        if seq is None:
            return  # aborted or failed meanwhile
        if seq.num_output_tokens or first.request_id in self._first_tokens or seq.status.is_finished:
            raise ValueError(f"{first.request_id} has its first token already")
        params = seq.params
        num_expected = (num_candidates(params.beam_width, len(engine.config.model.eos_token_ids))
                        if params.use_beam_search else params.n)
        vocab_size = engine.config.model.vocab_size
        if not (isinstance(first.token_ids, list) and len(first.token_ids) == num_expected
                and all(isinstance(t, int) and 0 <= t < vocab_size for t in first.token_ids)):
            raise ValueError(f"{first.request_id}: token_ids must be {num_expected} token ids in the vocabulary, "
                             f"got {first.token_ids!r}")
        num_tops = num_expected if params.top_logprobs else 0
        if len(first.logprobs) != num_expected or len(first.top_logprobs) != num_tops:
            raise ValueError(f"{first.request_id}: need {num_expected} logprobs and {num_tops} top logprobs, "
                             f"got {len(first.logprobs)} and {len(first.top_logprobs)}")
        rid = first.request_id
        self.receiver.all_sent(rid)
        if rid in self._arrived or not engine.may_accept_first_sample(seq):
            self._first_tokens[rid] = first
            self._start_if_ready(engine, rid)
            return
        # The KV is still on its way: the first token need not wait for it.
        for delta in engine.accept_first_sample(rid, _first_sample(first)):
            self.loop.publish_engine_delta(delta)
        if seq.status.is_finished:
            self._finished_first[rid] = seq
        else:
            self._streamed_first.add(rid)

    def _start_if_ready(self, engine: LLMEngine, request_id: str) -> None:
        if request_id not in self._arrived or request_id not in self._first_tokens:
            return
        self._arrived.discard(request_id)
        first = self._first_tokens.pop(request_id)
        for delta in engine.start_prefilled(request_id, _first_sample(first)):
            self.loop.publish_engine_delta(delta)

    def _tick(self) -> None:
        while (event := self.receiver.get_event(0)) is not None:
            rid = event.request_id
            finished = self._finished_first.pop(rid, None)
            seq = finished or self.engine.get_sequence(rid)
            if seq is None:
                continue
            self.metrics.transfer_ended(seq.arrival_time, None if event.status is TransferStatus.DONE else event.reason)
            if finished is not None:
                self.engine.release_blocks(finished)  # the receiver writes no more into them
            elif event.status is TransferStatus.DONE and rid in self._streamed_first:
                self._streamed_first.discard(rid)
                self.engine.start_prefilled(rid)
            elif event.status is TransferStatus.DONE:
                self._arrived.add(rid)
                self._start_if_ready(self.engine, rid)
            else:
                self._first_tokens.pop(rid, None)
                self._streamed_first.discard(rid)
                delta = self.engine.abort_request(rid)
                if delta is not None:
                    self.loop.publish_engine_delta(delta, error=f"the prompt's KV never arrived: {event.reason}")

    def _abort(self, engine: LLMEngine, request_id: str) -> bool:
        # NOTE: after receiver.abort returns, nothing writes into the request's blocks.
        self.receiver.abort(request_id)
        self._arrived.discard(request_id)
        self._first_tokens.pop(request_id, None)
        self._streamed_first.discard(request_id)
        finished = self._finished_first.pop(request_id, None)
        if finished is not None:  # its stream has ended: only its blocks are left
            engine.release_blocks(finished)
            return False
        delta = engine.abort_request(request_id)
        if delta is not None:
            self.loop.publish_engine_delta(delta)
        return delta is not None

    def shutdown(self) -> None:
        super().shutdown()
        self.receiver.close()
        if self._shared_pool is not None:
            self._shared_pool.close()


def _first_sample(first: PrefillResult) -> FirstSample:
    return FirstSample(first.token_ids, first.logprobs, first.top_logprobs)
