"""The colocated worker: prefill and decode in one engine (the same scheduler code), the
baseline the disaggregated cluster is measured against."""

from __future__ import annotations

from typing import AsyncIterator

from tandem.engine.engine import LLMEngine
from tandem.worker.api import Role, StreamDelta, WorkerRequest, checked
from tandem.worker.base import Worker
from tandem.worker.delta_reader import DeltaReader


class ColocatedWorker(Worker):
    role = Role.COLOCATED

    async def generate(self, request: WorkerRequest) -> AsyncIterator[StreamDelta]:
        """The request's deltas until its last; leaving early aborts it."""
        request = checked(request, WorkerRequest, "request")
        deltas = DeltaReader(self.loop.open_stream(request.request_id))
        finished = False
        try:
            await self.before_admission(request)
            await self.loop.call(lambda engine: engine.add_request(
                request.request_id, request.prompt_token_ids, request.params, priority=request.priority,
                num_resumed_tokens=request.num_resumed_tokens) and None)
            while not finished:
                delta = await deltas.next()
                finished = delta.request_finished
                yield delta
        finally:
            self.loop.close_stream(request.request_id)
            if not finished:
                await self.abort(request.request_id)

    async def abort(self, request_id: str) -> bool:
        return await self.loop.call(lambda engine: self._abort(engine, request_id))

    def _abort(self, engine: LLMEngine, request_id: str) -> bool:
        delta = engine.abort_request(request_id)
        if delta is not None:
            self.loop.publish_engine_delta(delta)
        return delta is not None
