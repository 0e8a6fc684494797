"""DeltaReader: the deltas already queued go out as one, in order, never past a finish."""

from __future__ import annotations

import asyncio

from tandem.logprobs import TopLogprobs
from tandem.router.delta_reader import DeltaReader, can_follow, merge
from tandem.worker.api import StreamDelta


def delta(tokens: list[int], index: int = 0, finish: str | None = None, error: str | None = None,
          logprobs: bool = False, unfinished: int = 0) -> StreamDelta:
    return StreamDelta("r", tokens, "".join(f"<{t}>" for t in tokens), finish, 5, max(tokens, default=0),
                       logprobs=[-float(t) for t in tokens] if logprobs else None,
                       top_logprobs=[TopLogprobs([t], [-float(t)]) for t in tokens] if logprobs else None,
                       error=error, index=index, num_unfinished=unfinished)


def read_all(queued: list[StreamDelta]) -> list[StreamDelta]:
    """Every delta the reader gives for ``queued`` (all queued before the first read)."""
    async def run() -> list[StreamDelta]:
        q: asyncio.Queue[StreamDelta] = asyncio.Queue()
        for d in queued:
            q.put_nowait(d)
        reader, out = DeltaReader(q), list[StreamDelta]()
        while not out or not out[-1].request_finished:
            out.append(await reader.next())
        return out
    return asyncio.run(run())


def test_queued_deltas_go_as_one_with_the_last_ones_counts_and_finish() -> None:
    out = read_all([delta([1]), delta([2]), delta([3], finish="length")])
    assert len(out) == 1
    assert out[0].token_ids == [1, 2, 3] and out[0].text == "<1><2><3>"
    assert out[0].finish_reason == "length" and out[0].num_output_tokens == 3 and out[0].request_finished


def test_logprobs_are_joined_in_token_order() -> None:
    [out] = read_all([delta([1], logprobs=True), delta([2, 3], logprobs=True, finish="stop")])
    assert out.logprobs == [-1.0, -2.0, -3.0]
    assert out.top_logprobs is not None and [t.token_ids for t in out.top_logprobs] == [[1], [2], [3]]


def test_completions_are_never_mixed_and_their_order_is_kept() -> None:
    out = read_all([delta([1], index=0, unfinished=2), delta([2], index=0, unfinished=2),
                    delta([7], index=1, unfinished=2), delta([3], index=0, finish="length", unfinished=1),
                    delta([8], index=1, finish="length")])
    assert [(d.index, d.token_ids) for d in out] == [(0, [1, 2]), (1, [7]), (0, [3]), (1, [8])]
    assert [d.request_finished for d in out] == [False, False, False, True]


def test_an_error_or_a_finish_ends_a_merge() -> None:
    assert not can_follow(delta([1], finish="stop", unfinished=1), delta([2]))
    assert not can_follow(delta([1], error="boom"), delta([2]))
    assert can_follow(delta([1]), delta([], error="boom"))
    merged = merge(delta([1]), delta([], finish="abort", error="boom"))
    assert merged.token_ids == [1] and merged.error == "boom" and merged.request_finished


def test_a_delta_alone_goes_at_once_without_waiting_for_more() -> None:
    async def run() -> tuple[StreamDelta, StreamDelta]:
        q: asyncio.Queue[StreamDelta] = asyncio.Queue()
        reader = DeltaReader(q)
        q.put_nowait(delta([1]))
        first = await asyncio.wait_for(reader.next(), 5)  # nothing else queued: it does not wait
        q.put_nowait(delta([2], finish="length"))
        return first, await asyncio.wait_for(reader.next(), 5)
    first, second = asyncio.run(run())
    assert first.token_ids == [1] and second.token_ids == [2] and second.request_finished
