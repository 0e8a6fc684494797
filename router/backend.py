"""What the gRPC servicer needs from the workers behind it: one narrow interface, so the
servicer is the same whether the workers are Ray actors (disaggregated or colocated) or
an engine in this process."""

from __future__ import annotations

from typing import TYPE_CHECKING, AsyncIterator, Protocol

from tandem.router.worker_metrics import WorkerMetricsReport
from tandem.sampling_params import SamplingParams
from tandem.worker.api import StreamDelta, TokenizerSpec, WorkerLoad

if TYPE_CHECKING:
    from tandem.router.metrics import RouterMetrics


class Overloaded(RuntimeError):
    """Every worker's queue or KV pool is full: RESOURCE_EXHAUSTED."""


class NoHealthyWorker(RuntimeError):
    """No worker can serve the request: UNAVAILABLE."""


class WorkerFailed(NoHealthyWorker):
    """A worker serving the request died or hung before it ended: UNAVAILABLE, unless the
    request is buffered (then it runs again elsewhere)."""


class Backend(Protocol):
    @property
    def tokenizer_spec(self) -> TokenizerSpec:
        """The tokenizer the workers use (the router tokenizes with it)."""
        ...

    metrics: RouterMetrics | None
    """Set by the router (serve): where the backend records admission queue times."""

    @property
    def num_admitting(self) -> int:
        """Requests waiting in the backend's admission queue now."""
        ...

    def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 priority: int = 0, num_resumed_tokens: int = 0) -> AsyncIterator[StreamDelta]:
        """Stream a request's deltas until the one with ``request_finished``. With n > 1 the
        completions' deltas interleave (``StreamDelta.index``), each completion's last one
        with its own finish_reason. ``priority``: vLLM's request priority, for workers that
        schedule by it (WorkerRequest.priority). ``num_resumed_tokens``: the last this many of
        prompt_token_ids are output its client has already (a migrated request, n=1:
        WorkerRequest.num_resumed_tokens); the deltas then carry only what follows them.

        Raises Overloaded or NoHealthyWorker (WorkerFailed when a worker serving it died or
        hung: deltas never carry `error` out of a backend); ValueError for a request the
        workers refuse.
        `aclose()` before the end (client cancel, deadline) aborts the request on every
        worker that holds it.
        """
        ...

    async def abort(self, request_id: str) -> bool:
        """Abort a request wherever it is. -> whether it was running."""
        ...

    async def loads(self) -> list[WorkerLoad]:
        """Every worker's current load (also how health is judged)."""
        ...

    async def worker_metrics(self) -> list[WorkerMetricsReport]:
        """Every worker's metrics in Prometheus' text format (None for one that did not answer)."""
        ...

    def is_ready(self) -> bool:
        """Whether the workers are loaded and serving."""
        ...
