"""Buffered requests: the whole output goes to the client in one piece at the end, so a
request whose worker fails midway can run again from the start on healthy workers without
the client ever seeing two different beginnings."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from typing import TypeVar, cast

from tandem.router.backend import Backend, WorkerFailed
from tandem.sampling_params import SamplingParams
from tandem.worker.api import StreamDelta

logger = logging.getLogger(__name__)

T = TypeVar("T")

MAX_RERUNS = 2
"""Runs after the first, each on the workers healthy at that moment."""


def merged(deltas: list[StreamDelta]) -> StreamDelta:
    """One delta holding one completion's whole output (its last delta carries the finish);
    logprobs and top_logprobs joined in token order (None when no delta had them)."""
    last = deltas[-1]
    return dataclasses.replace(last, token_ids=[t for d in deltas for t in d.token_ids],
                               text="".join(d.text for d in deltas), logprobs=_joined(d.logprobs for d in deltas),
                               top_logprobs=_joined(d.top_logprobs for d in deltas))


def _joined(lists: Iterable[list[T] | None]) -> list[T] | None:
    lists = list(lists)
    if all(entries is None for entries in lists):
        return None
    return [entry for entries in lists for entry in entries or ()]


def merged_by_index(deltas: list[StreamDelta]) -> list[StreamDelta]:
    """A run's deltas -> one merged delta per completion, in index order, each carrying the
    run's total num_output_tokens (the last delta's). When the run finished, num_unfinished
    counts down to 0 on the last, so that only it is the request's finish; a run that did
    not finish keeps its counts (none looks finished), and a failed one is its error delta."""
    if not deltas or deltas[-1].error is not None:
        return deltas[-1:]
    by_index: dict[int, list[StreamDelta]] = {}
    for delta in deltas:
        by_index.setdefault(delta.index, []).append(delta)
    last = deltas[-1]
    indexes = sorted(by_index)
    return [dataclasses.replace(merged(by_index[index]), num_output_tokens=last.num_output_tokens,
                                num_unfinished=(len(indexes) - 1 - position if last.request_finished
                                                else by_index[index][-1].num_unfinished))
            for position, index in enumerate(indexes)]


async def generate_buffered(backend: Backend, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                            on_rerun: Callable[[], None], priority: int = 0) -> AsyncIterator[StreamDelta]:
    """backend.generate, yielding one merged delta per completion (see merged_by_index) once
    the request finished. WorkerFailed runs it again (up to MAX_RERUNS times, while the
    backend is ready, each run with the same ``priority``); on_rerun counts it."""
    for run in range(MAX_RERUNS + 1):
        deltas: list[StreamDelta] = []
        # Backend.generate's streams have aclose() (see its docstring): async generators.
        stream = cast(AsyncGenerator[StreamDelta, None],
                      backend.generate(request_id, prompt_token_ids, params, priority=priority))
        try:
            async for delta in stream:
                deltas.append(delta)
                if delta.request_finished:
                    break
        except WorkerFailed as e:
            if run == MAX_RERUNS or not backend.is_ready():
                raise
            logger.warning("request %s: %s; running it again (rerun %d of %d)", request_id, e, run + 1, MAX_RERUNS)
            on_rerun()
            continue
        finally:
            await stream.aclose()  # what aborts the run on the workers, if it ended early
        for delta in merged_by_index(deltas):
            yield delta
        return
