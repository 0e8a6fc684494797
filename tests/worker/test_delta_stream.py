"""DeltaStream: deltas held until their reader binds, then sent on the publishing thread, in
order; the reader's future ends with the request's last delta or the error its send raised."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tandem.worker.api import StreamDelta
from tandem.worker.delta_stream import DeltaStream


def delta(tokens: list[int], finish: str | None = None) -> StreamDelta:
    return StreamDelta("r", tokens, "", finish, 3, len(tokens))


def test_deltas_published_before_the_reader_go_first_in_order() -> None:
    async def main() -> list[list[int]]:
        stream, sent = DeltaStream("r"), list[StreamDelta]()
        stream.put(delta([1]))
        stream.put(delta([2]))
        done = stream.bind(sent.append)
        assert not done.done()  # the last delta has not come yet
        stream.put(delta([3], finish="length"))
        await asyncio.wait_for(done, 5)
        return [d.token_ids for d in sent]
    assert asyncio.run(main()) == [[1], [2], [3]]


def test_a_request_finished_before_its_reader_came_ends_at_bind() -> None:
    async def main() -> list[StreamDelta]:
        stream, sent = DeltaStream("r"), list[StreamDelta]()
        stream.put(delta([1], finish="stop"))
        stream.put(delta([], finish="abort"))  # e.g. an abort racing the finish: its reader never sees it
        await asyncio.wait_for(stream.bind(sent.append), 5)
        return sent
    sent = asyncio.run(main())
    assert [(d.token_ids, d.finish_reason) for d in sent] == [([1], "stop")]


def test_deltas_sent_from_another_thread_are_sent_there_and_end_the_readers_wait() -> None:
    async def main() -> tuple[list[int], set[str]]:
        stream, tokens, threads = DeltaStream("r"), list[int](), set[str]()

        def send(d: StreamDelta) -> None:
            threads.add(threading.current_thread().name)
            tokens.extend(d.token_ids)
        done = stream.bind(send)

        def publish() -> None:
            for i in range(100):
                stream.put(delta([i], "length" if i == 99 else None))
        publisher = threading.Thread(target=publish, name="engine")
        publisher.start()
        await asyncio.wait_for(done, 5)
        publisher.join()
        return tokens, threads
    tokens, threads = asyncio.run(main())
    assert tokens == list(range(100)) and threads == {"engine"}


def test_a_send_that_fails_ends_the_readers_wait_with_its_error_and_gets_nothing_more() -> None:
    calls: list[StreamDelta] = []

    def send(d: StreamDelta) -> None:
        calls.append(d)
        raise ConnectionError("inbox gone")

    async def main() -> None:
        stream = DeltaStream("r")
        done = stream.bind(send)
        stream.put(delta([1]))  # the publisher never sees the error
        stream.put(delta([2], finish="length"))
        await asyncio.wait_for(done, 5)
    with pytest.raises(ConnectionError, match="inbox gone"):
        asyncio.run(main())
    assert [d.token_ids for d in calls] == [[1]]


def test_a_stream_takes_one_reader() -> None:
    async def main() -> None:
        stream = DeltaStream("r")
        stream.bind(lambda d: None)
        stream.bind(lambda d: None)
    with pytest.raises(ValueError, match="has a reader already"):
        asyncio.run(main())
