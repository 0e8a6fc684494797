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
gone, a reader that leaves early) ends the stream at once and frees the blocks once the
receiver writes no more into them: at once, or, when a same-node writer is inside a write
(or stopped there), at the end of its revoke. KV that fails or times out aborts the request
with an error delta. A dead worker's pool dies with its process.
Each step of the way is a state of the worker's handoff table (handoff.py).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from tandem.config import WorkerConfig
from tandem.decode_node.handoff import DecodeHandoff as S
from tandem.decode_node.handoff import Handoff, handoff_table
from tandem.decoding.beam_search import num_candidates
from tandem.engine.engine import LLMEngine
from tandem.engine.model_runner import private_pool
from tandem.engine.snapshots import EngineInventory
from tandem.kvtransfer.cuda_ipc import DevicePoolExport
from tandem.kvtransfer.curve import CurveKeys
from tandem.kvtransfer.handshake import SharedPool
from tandem.kvtransfer.payload import layout_for
from tandem.kvtransfer.placement import host_identity
from tandem.kvtransfer.protocol import AbortOutcome, Destination, TransferEvent, TransferStatus
from tandem.kvtransfer.receiver import DEFAULT_ADDRESS, KVReceiver
from tandem.kvtransfer.shared_pool import SHM_DIR, HostSharedPool
from tandem.outputs import FirstSample
from tandem.parallel.runner import TensorParallelRunner
from tandem.worker.api import PoolFull, PrefillResult, Role, StreamDelta, WorkerRequest, checked
from tandem.worker.base import Worker
from tandem.worker.delta_stream import Send
from tandem.worker.engine_loop import EngineLoop
from tandem.worker.state_table import StateTable

logger = logging.getLogger(__name__)


class DecodeWorker(Worker):
    role = Role.DECODE

    def __init__(self, config: WorkerConfig, instance: str = "decode-0", placement_group: Any = None) -> None:
        """config.kv_transfer: where the receiver listens, how long a reservation waits for
        the rest of its KV after the latest layer message (a prompt queued on the prefill
        worker has no deadline here: the router ends its reservation on every exit path), and
        the prefill workers' transport (kvtransfer.connectors.registry.kv_transports()): only auto writes
        into a pool in host shared memory (SHM_DIR), so the others need none; a pool on a GPU
        is exported by CUDA IPC to a sender on the same GPU unless zmq (two pools on one GPU
        never pair: path_choice.py). The receiver takes any path a sender asks for that its
        pool allows (torch.distributed pairs: dist_pairs.py)."""
        kv = self._kv = config.kv_transfer
        self._shared_pool: SharedPool | None = None
        """The KV pool offered to same-node senders (tensor_parallel_size 1): its file in
        shared memory, or, on a GPU, its CUDA IPC export."""

        def allocate_kv(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            if device.type == "cuda":  # the pool stays on its GPU; its grant table goes to SHM_DIR
                pool = private_pool(shape, dtype, device)
                self._shared_pool = (None if kv.transport == "zmq" else DevicePoolExport.create(
                    pool, layout_for(shape, dtype), kv.node_id or host_identity(), SHM_DIR))
                return pool
            # None when SHM_DIR has no room: a private pool, KV by socket only.
            host = HostSharedPool.create(shape, dtype, SHM_DIR) if kv.transport == "auto" else None
            self._shared_pool = host
            return private_pool(shape, dtype, device) if host is None else host.kv_cache

        self.handoffs: StateTable[S, Handoff] = handoff_table()
        """Where each reserved request stands until it runs or is freed (the loop thread's)."""
        self._readers: set[str] = set()
        """Requests whose stream is being read (on the actor's event loop)."""
        super().__init__(config, instance, placement_group, allocate_kv)

    def _start_loop(self) -> EngineLoop:
        runner = self.engine.runner
        # Tensor-parallel: arriving KV waits on the first rank for the next step, which
        # carries it to every rank (see parallel.kv_writes).
        sink = runner.kv_writes if isinstance(runner, TensorParallelRunner) else None
        kv = self._kv
        self.receiver = KVReceiver(runner.kv_cache, kv.receiver_address or DEFAULT_ADDRESS, kv.timeout_s,
                                   model=self.fingerprint, sink=sink, shared_pool=self._shared_pool,
                                   node_id=kv.node_id, curve=CurveKeys.from_env(),
                                   allow_unencrypted_pairs=kv.allow_unencrypted_pairs)
        self.metrics.kv_bytes["received"] = lambda: self.receiver.num_bytes_received
        self.metrics.kv_dropped = lambda: dict(self.receiver.dropped)
        self.metrics.num_transferring = lambda: self.receiver.num_pending
        return EngineLoop(self.engine, tick=self._tick, on_down=self._engine_down)

    def _held(self, inventory: EngineInventory) -> dict[str, int]:
        h = self.handoffs
        return dict(num_reserved=inventory.num_reserved,
                    num_first_tokens=h.count(S.FIRST_TOKEN_HELD, S.FIRST_TOKEN_SENT, S.ENDED_BEFORE_KV),
                    num_arrived=h.count(S.READY), num_pending_transfers=self.receiver.num_pending,
                    num_aborting=h.count(S.ABORTING))

    async def reserve(self, request: WorkerRequest) -> Destination:
        """Hold blocks for the request's prompt and wait for its KV. Raises PoolFull when the
        pool cannot hold it now; call `stream` next to read its output."""
        request = checked(request, WorkerRequest, "request")
        self.loop.open_stream(request.request_id)
        try:
            await self.before_admission(request)
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
            await self.before_admission(request)
            await self.loop.call(lambda engine: self._prefill_local(engine, request))
        except BaseException:
            self.loop.close_stream(request.request_id)
            raise

    async def start(self, first: PrefillResult) -> None:
        """The prefill worker's first token: decoding starts once the KV has arrived too."""
        first = checked(first, PrefillResult, "first")
        await self.loop.call(lambda engine: self._start(engine, first))

    async def stream(self, request_id: str, send: Send) -> None:
        """Send the request's deltas to ``send`` (on the engine thread) until its last, the
        ones published before this call first; leaving early aborts it."""
        try:
            stream = self.loop.stream(request_id)
        except KeyError:  # aborted before its reader came
            send(StreamDelta(request_id, [], "", "abort", 0, 0))
            return
        self._readers.add(request_id)
        try:
            await self.send_deltas(stream, send)
        finally:
            self._readers.discard(request_id)

    async def abort(self, request_id: str) -> bool:
        aborted = await self.loop.call(lambda engine: self._abort(engine, request_id))
        if request_id not in self._readers:  # reserved, but nobody came (or will come) to read it
            self.loop.close_stream(request_id)
        return aborted

    # -- on the loop thread -------------------------------------------------------------
    def _reserve(self, engine: LLMEngine, request: WorkerRequest) -> Destination:
        block_ids = engine.reserve_prefilled(request.request_id, request.prompt_token_ids, request.params,
                                             request.priority, request.num_resumed_tokens)
        if block_ids is None:
            raise PoolFull(f"{self.instance}: no room for {len(request.prompt_token_ids)} prompt tokens now")
        # Only the KV after the prefix this pool caches already is sent.
        seq = engine.get_sequence(request.request_id)
        assert seq is not None  # (reserved just now)
        num_cached = seq.num_cached_prompt_tokens
        dest = self.receiver.expect(request.request_id, block_ids, len(request.prompt_token_ids),
                                    num_cached_tokens=num_cached)
        self.handoffs.begin(request.request_id, Handoff())
        return dest

    def _prefill_local(self, engine: LLMEngine, request: WorkerRequest) -> None:
        if not engine.may_add_request(request.prompt_token_ids, request.params):
            raise PoolFull(f"{self.instance}: no room for {len(request.prompt_token_ids)} prompt tokens now")
        engine.add_request(request.request_id, request.prompt_token_ids, request.params, priority=request.priority,
                           num_resumed_tokens=request.num_resumed_tokens)

    def _start(self, engine: LLMEngine, first: PrefillResult) -> None:
        rid = first.request_id
        seq, h = engine.get_sequence(rid), self.handoffs.get(rid)
        if seq is None:
            return  # aborted or failed meanwhile
        if h is None or h.state not in (S.RESERVED, S.READY):
            raise ValueError(f"{rid} has its first token already")
        params = seq.params
        num_expected = (num_candidates(params.beam_width, len(engine.config.model.eos_token_ids))
                        if params.use_beam_search else params.n)
        vocab_size = engine.config.model.vocab_size
        if not (isinstance(first.token_ids, list) and len(first.token_ids) == num_expected
                and all(isinstance(t, int) and 0 <= t < vocab_size for t in first.token_ids)):
            raise ValueError(f"{rid}: token_ids must be {num_expected} token ids in the vocabulary, "
                             f"got {first.token_ids!r}")
        num_tops = num_expected if params.top_logprobs else 0
        if len(first.logprobs) != num_expected or len(first.top_logprobs) != num_tops:
            raise ValueError(f"{rid}: need {num_expected} logprobs and {num_tops} top logprobs, "
                             f"got {len(first.logprobs)} and {len(first.top_logprobs)}")
        self.receiver.all_sent(rid)
        if h.state is S.READY:
            self._run_prefilled(rid, first)
        elif not engine.may_accept_first_sample(seq):
            self.handoffs.move(rid, S.FIRST_TOKEN_HELD, first=first)
        else:  # the KV is still on its way: the first token need not wait for it
            for delta in engine.accept_first_sample(rid, _first_sample(first)):
                self.loop.publish_engine_delta(delta)
            if seq.status.is_finished:
                self.handoffs.move(rid, S.ENDED_BEFORE_KV, seq=seq)
            else:
                self.handoffs.move(rid, S.FIRST_TOKEN_SENT)

    def _run_prefilled(self, request_id: str, first: PrefillResult | None) -> None:
        """KV and first token both here: the request joins the running batch (first None: the
        token went out already)."""
        self.handoffs.move(request_id, S.RUNNING)
        for delta in self.engine.start_prefilled(request_id, None if first is None else _first_sample(first)):
            self.loop.publish_engine_delta(delta)

    def _tick(self) -> None:
        while (event := self.receiver.get_event(0)) is not None:
            rid = event.request_id
            h = self.handoffs.get(rid)
            if h is None:
                continue
            if h.state in (S.ABORTING, S.ENDED_BEFORE_KV):  # the receiver writes no more into its blocks
                assert h.seq is not None
                if h.state is S.ENDED_BEFORE_KV:
                    self.metrics.transfer_ended(h.seq.arrival_time, _failure(event))
                self.engine.release_blocks(h.seq)
                self.handoffs.move(rid, S.FREED)
                continue
            seq = self.engine.get_sequence(rid)
            assert seq is not None, f"{rid} is {h.state.name} with no sequence"
            self.metrics.transfer_ended(seq.arrival_time, _failure(event))
            if event.status is not TransferStatus.DONE:
                self.handoffs.move(rid, S.FREED)
                seq.keep_blocks = False  # (nothing writes into them any more)
                delta = self.engine.abort_request(rid)
                if delta is not None:
                    self.loop.publish_engine_delta(delta, error=f"the prompt's KV never arrived: {event.reason}")
            elif h.state is S.RESERVED:
                self.handoffs.move(rid, S.READY)
            else:  # FIRST_TOKEN_SENT (its token is out) or FIRST_TOKEN_HELD
                self._run_prefilled(rid, h.first)

    def _abort(self, engine: LLMEngine, request_id: str) -> bool:
        # Never waits: a same-node writer stopped inside a write keeps only this request's
        # blocks, until the receiver's revoke returns (its event, in _tick).
        outcome = self.receiver.abort(request_id)
        h = self.handoffs.get(request_id)
        if h is None:  # running, prefilled here, or unknown
            delta = engine.abort_request(request_id)
        elif h.state is S.ABORTING:
            return False
        else:
            revoking = outcome is AbortOutcome.REVOKING
            seq = h.seq if h.state is S.ENDED_BEFORE_KV else engine.get_sequence(request_id)
            assert seq is not None, f"{request_id} is {h.state.name} with no sequence"
            seq.keep_blocks = revoking  # NOTE: the blocks stay held until the revoke has returned
            if h.state is S.ENDED_BEFORE_KV:  # its stream has ended: only its blocks are left
                delta = None
                if not revoking:
                    engine.release_blocks(seq)
            else:
                delta = engine.abort_request(request_id)
            self.handoffs.move(request_id, S.ABORTING if revoking else S.FREED, seq=seq if revoking else None)
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


def _failure(event: TransferEvent) -> str | None:
    """The transfer-time metric's failure reason (None: it arrived)."""
    return None if event.status is TransferStatus.DONE else event.reason
