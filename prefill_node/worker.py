"""The prefill worker: computes prompts' KV, streams each layer to the decode worker that
reserved blocks for it, and returns the first sampled token.

A request's life here (the whole way: docs/architecture.md):
1. admitted: `prefill` connects to the decode worker's receiver and queues the prompt with
   max_tokens=1; its blocks are kept past the sequence's end (`keep_blocks`).
2. prefilling: chunk by chunk, each layer's new KV is sent as soon as it is stored
   (`_send_layer`, on the engine loop, during the forward).
3. first token: sampled after the last chunk; `prefill` returns it and the sequence ends.
4. sent: the sender reports the receiver's ack (`_tick`); only then are the blocks freed.
Exits: `abort` (cancel, deadline, the decode worker gone) or a transfer that fails or times
out ends the sequence at once, but its blocks are freed only in `_tick`, once the sender
says ZMQ no longer reads them. A dead worker's pool dies with its process.
Each step of the way is a state of the worker's handoff table (handoff.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from tandem.config import WorkerConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.hooks import PrefillHooks
from tandem.engine.model_runner import ModelRunner
from tandem.engine.scheduler import ScheduledBatch
from tandem.engine.sequence import Sequence
from tandem.engine.snapshots import EngineInventory
from tandem.kvtransfer.curve import CurveKeys
from tandem.kvtransfer.peer import Peer
from tandem.kvtransfer.protocol import Destination, TransferStatus
from tandem.kvtransfer.sender import KVSender
from tandem.kvtransfer.slots import token_slots
from tandem.outputs import RequestDelta
from tandem.parallel.runner import TensorParallelRunner
from tandem.prefill_node.handoff import TRANSITIONS, PrefillHandoff
from tandem.prefill_node.handoff import PrefillHandoff as P
from tandem.worker.api import EngineDown, PrefillResult, Role, WorkerRequest, checked
from tandem.worker.base import Worker
from tandem.worker.engine_loop import IDLE_REST_S, IDLE_WAIT_S, EngineLoop
from tandem.worker.state_table import StateTable

logger = logging.getLogger(__name__)


@dataclass
class _Prefill:
    seq: Sequence
    result: asyncio.Future
    loop: asyncio.AbstractEventLoop
    state: PrefillHandoff = P.PREFILLING
    started: float = dataclasses.field(default_factory=time.monotonic)
    """When the transfer began (for the transfer time metric)."""
    num_sent_tokens: int = 0
    """Prompt tokens whose KV went out in every layer, or that the receiver holds already."""


class PrefillWorker(Worker):
    role = Role.PREFILL

    def __init__(self, config: WorkerConfig, instance: str = "prefill-0", placement_group: Any = None) -> None:
        """config.kv_transfer: how the KV goes out (its transport, timeout, checksum, and node:
        decode workers on the same one get the KV written straight into their shared pools)."""
        self._kv = config.kv_transfer
        self.handoffs: StateTable[PrefillHandoff, _Prefill] = StateTable(P.PREFILLING, TRANSITIONS)
        """Where each admitted request stands until its blocks are free (the loop thread's)."""
        super().__init__(config, instance, placement_group)

    def _prefill_hooks(self, runner: ModelRunner) -> PrefillHooks:
        # Tensor-parallel: each rank holds some heads; the first collects every head of the
        # rows sent (send_plan tells the ranks which) and sends them as one pool would.
        self._tp_runner = runner if isinstance(runner, TensorParallelRunner) else None
        return PrefillHooks(self._send_layer, self._on_delta, None if self._tp_runner is None else self._send_plan)

    def _start_loop(self) -> EngineLoop:
        runner = self.engine.runner
        layout = None if self._tp_runner is None else self._tp_runner.layout
        kv = self._kv
        self.sender = KVSender(runner.kv_cache, timeout_s=kv.timeout_s, model=self.fingerprint,
                               checksum=kv.checksum, layout=layout, node_id=kv.node_id, transport=kv.transport,
                               curve=CurveKeys.from_env(), allow_unencrypted_pairs=kv.allow_unencrypted_pairs)
        self.metrics.kv_bytes["sent"] = lambda: self.sender.num_bytes_sent
        self.metrics.num_transferring = lambda: self.sender.num_pending
        return EngineLoop(self.engine, tick=self._tick, on_down=self._engine_down, idle_wait=self._idle_wait)

    def _idle_wait(self) -> float:
        """Tick often while a transfer is in flight (acks, timeouts); with none, only a command
        (which wakes the loop) brings work: an idle prefill worker then leaves the cores to the
        decode worker's steps."""
        return IDLE_WAIT_S if len(self.handoffs) or self.sender.num_pending else IDLE_REST_S

    def _held(self, inventory: EngineInventory) -> dict[str, int]:
        return dict(num_pending_transfers=self.sender.num_pending, num_kept=len(self.handoffs))

    async def prefill(self, request: WorkerRequest, destination: Destination) -> PrefillResult:
        """Prefill `request` into `destination`; -> its first token once sampled (the KV is
        then on its way; the decode worker learns of its arrival from the transfer)."""
        request = checked(request, WorkerRequest, "request")
        destination = checked(destination, Destination, "destination")
        if destination.request_id != request.request_id:
            raise ValueError(f"the destination is for {destination.request_id!r}, "
                             f"the request is {request.request_id!r}")
        await self.before_admission(request)
        result = asyncio.get_running_loop().create_future()
        peer = None
        if not self.sender.is_connected(destination.address):
            # Refused before any handshake.
            await self.loop.call(lambda engine: self._check(engine, request, destination))
            # NOTE: off the engine loop: a receiver that answers late stalls only this request.
            peer = await asyncio.to_thread(self.sender.handshake, destination.address, destination=destination)
        try:
            await self.loop.call(lambda engine: self._admit(engine, request, destination, result, peer))
            return await result
        except asyncio.CancelledError:  # the admission may have run all the same: undo it
            await self.abort(request.request_id)
            raise

    # -- on the loop thread -------------------------------------------------------------
    def _admit(self, engine: LLMEngine, request: WorkerRequest, destination: Destination, result: asyncio.Future,
               peer: Peer | None) -> None:
        if peer is not None:
            self.sender.adopt(destination.address, peer)
        self._check(engine, request, destination)
        # One token: the first (of each completion, or the beams' candidates); the decode
        # worker samples the rest with the request's own params. (min_tokens >= 1 still keeps
        # EOS from the first.)
        num_output = request.num_resumed_tokens + 1  # (a resumed request's output so far, then the first)
        params = dataclasses.replace(request.params, max_tokens=num_output, stop=(),
                                     min_tokens=min(request.params.min_tokens, num_output))
        path = self.sender.begin(destination)  # first: a refused handshake must leave no sequence behind
        self.metrics.transfer_began(path)
        # Its blocks are freed once the decode worker has the KV (see _tick).
        seq = engine.add_request(request.request_id, request.prompt_token_ids, params, keep_blocks=True,
                                 priority=request.priority, num_resumed_tokens=request.num_resumed_tokens)
        # The receiver's cached prefix is never sent: start counting after it.
        self.handoffs.begin(request.request_id, _Prefill(seq, result, result.get_loop(),
                                                         num_sent_tokens=destination.num_cached_tokens))

    def _check(self, engine: LLMEngine, request: WorkerRequest, destination: Destination) -> None:
        """ValueError for a request (or destination) the engine cannot take."""
        if destination.num_tokens != len(request.prompt_token_ids):
            raise ValueError(f"{request.request_id}: the destination holds {destination.num_tokens} tokens, "
                             f"the prompt has {len(request.prompt_token_ids)}")
        num_cached = destination.num_cached_tokens
        if not (isinstance(num_cached, int) and 0 <= num_cached < destination.num_tokens):
            raise ValueError(f"{request.request_id}: the destination's num_cached_tokens {num_cached!r} is not "
                             f"in [0, {destination.num_tokens})")
        engine.check_request(request.request_id, request.prompt_token_ids, request.priority)

    def _sends(self, batch: ScheduledBatch) -> list[tuple[_Prefill, int]]:
        """The step's prefills whose KV goes out, each with the end of the tokens it sends
        (from its num_sent_tokens)."""
        sends = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            p = self.handoffs.get(seq.request_id)
            end = seq.num_computed_tokens + n  # a cached prefix goes out with the first chunk
            if p is not None and end > p.num_sent_tokens:
                sends.append((p, end))
        return sends

    def _send_plan(self, batch: ScheduledBatch) -> np.ndarray:
        """The cache slots _send_layer sends, in its order (for a tensor-parallel runner)."""
        bs = self.engine.config.block_size
        slots = [token_slots(p.seq.block_ids, bs, p.num_sent_tokens, end) for p, end in self._sends(batch)]
        return np.concatenate(slots) if slots else np.zeros(0, dtype=np.int64)

    def _send_layer(self, batch: ScheduledBatch, layer: int) -> None:
        offset = 0
        sends = self._sends(batch)
        for p, end in sends:
            if p.state is P.PREFILLING:
                self.handoffs.move(p.seq.request_id, P.SENDING)
            rows = None
            if self._tp_runner is not None:
                rows = self._tp_runner.gathered_rows(offset, end - p.num_sent_tokens)
                offset += end - p.num_sent_tokens
            self.sender.send_layer(p.seq.request_id, layer, p.num_sent_tokens, end, src_block_ids=p.seq.block_ids,
                                   rows=rows)
        if layer == self.engine.config.model.num_layers - 1:
            # A chunk inside the receiver's cached prefix leaves the count as it is.
            for p, end in sends:
                p.num_sent_tokens = end

    def _on_delta(self, d: RequestDelta) -> None:
        p = self.handoffs.get(d.request_id)
        # (PREFILLING here is a bug the move asserts: the last chunk always sends KV.)
        if p is None or p.state not in (P.PREFILLING, P.SENDING):
            return
        sample = LLMEngine.first_sample(p.seq)
        if sample is None:
            return
        self.handoffs.move(d.request_id, P.SENT)
        result = PrefillResult(d.request_id, sample.token_ids, sample.logprobs, d.num_cached_tokens,
                               sample.top_logprobs)
        p.loop.call_soon_threadsafe(_resolve, p.result, result, None)

    def _tick(self) -> None:
        for event in self.sender.poll():
            p = self.handoffs.get(event.request_id)
            if p is None:
                continue
            ended = p.state is P.ABORTED
            self.handoffs.move(event.request_id, P.FREED)
            if event.status is not TransferStatus.DONE and not ended:
                self.engine.abort_request(event.request_id)
            # The KV has arrived, or never will; ZMQ has let go of the blocks either way.
            self.engine.release_blocks(p.seq)
            self.metrics.transfer_ended(p.started, None if event.status is TransferStatus.DONE else event.reason)
            if event.status is not TransferStatus.DONE:
                error = RuntimeError(f"KV transfer of {event.request_id} failed: {event.reason}")
                p.loop.call_soon_threadsafe(_resolve, p.result, None, error)

    def _abort(self, engine: LLMEngine, request_id: str) -> bool:
        p = self.handoffs.get(request_id)
        if p is None or p.state is P.ABORTED:
            return False
        self.handoffs.move(request_id, P.ABORTED)
        engine.abort_request(request_id)
        # NOTE: the blocks are freed in _tick when the sender reports the end, never here:
        # ZMQ may still be reading them.
        self.sender.abort(request_id)
        p.loop.call_soon_threadsafe(_resolve, p.result, None, RuntimeError(f"{request_id} was aborted"))
        return True

    def _fail_waiting(self, down: EngineDown) -> None:
        for _, p in self.handoffs.items():
            p.loop.call_soon_threadsafe(_resolve, p.result, None, down)


def _resolve(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
