"""The colocated worker: prefill and decode in one engine (the same scheduler code), the
baseline the disaggregated cluster is measured against."""

from __future__ import annotations

from tandem.engine.engine import LLMEngine
from tandem.worker.api import Role, WorkerRequest, checked
from tandem.worker.base import Worker
from tandem.worker.delta_stream import Send


class ColocatedWorker(Worker):
    role = Role.COLOCATED

    async def generate(self, request: WorkerRequest, send: Send) -> None:
        """Run the request, its deltas sent to ``send`` (on the engine thread) until its
        last; leaving early aborts it."""
        request = checked(request, WorkerRequest, "request")
        stream = self.loop.open_stream(request.request_id)
        try:
            await self.before_admission(request)
            await self.loop.call(lambda engine: engine.add_request(
                request.request_id, request.prompt_token_ids, request.params, priority=request.priority,
                num_resumed_tokens=request.num_resumed_tokens) and None)
        except BaseException:  # a cancelled call's admission may have run all the same: undo it
            self.loop.close_stream(request.request_id)
            await self.abort(request.request_id)
            raise
        await self.send_deltas(stream, send)

    def _abort(self, engine: LLMEngine, request_id: str) -> bool:
        delta = engine.abort_request(request_id)
        if delta is not None:
            self.loop.publish_engine_delta(delta)
        return delta is not None
