"""The router's inbox over real sockets: each request's deltas reach its own queue in the
order its worker sent them; frames of nobody's request and malformed frames are dropped
without stopping it; under the cluster's CurveZMQ keys only a keyed worker gets through.
And following a stream (router/worker_stream.py): deltas still on the wire when the
worker's call returned are read, a call that fails ends the stream, and a last delta that
never comes ends it after LAST_DELTAS_TIMEOUT_S with every holder told to abort."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import zmq
from ray.exceptions import RayActorError
from test_worker_health import Handle, Method

from tandem.kvtransfer.curve import CurveKeys
from tandem.router import worker_stream
from tandem.router.backend import WorkerFailed
from tandem.router.delta_inbox import DeltaInbox
from tandem.router.policy import WorkerState
from tandem.router.worker_calls import WorkerCalls
from tandem.router.worker_stream import WorkerStreams
from tandem.sampling_params import SamplingParams
from tandem.worker.api import StreamDelta, WorkerRequest
from tandem.worker.delta_outbox import DeltaOutbox

SECRET = "a cluster secret of enough characters"


def delta(request_id: str, token: int, finish: str | None = None) -> StreamDelta:
    return StreamDelta(request_id, [token], f"<{token}>", finish, 3, token)


async def read(queue: asyncio.Queue, n: int, timeout_s: float = 5.0) -> list:
    return [await asyncio.wait_for(queue.get(), timeout_s) for _ in range(n)]


def test_each_request_gets_its_own_deltas_in_order() -> None:
    async def body() -> None:
        inbox = DeltaInbox()
        inbox.start()
        a, b = inbox.open("a"), inbox.open("b")
        with pytest.raises(ValueError, match="already"):
            inbox.open("a")
        outbox, other = DeltaOutbox(), DeltaOutbox()  # two workers
        for i in range(50):
            outbox.send(inbox.address, delta("a", i))
            other.send(inbox.address, delta("b", 100 + i))
            outbox.send(inbox.address, delta("gone", i))  # nobody reads it: dropped
        assert [d.token_ids[0] for d in await read(a, 50)] == list(range(50))
        assert [d.token_ids[0] for d in await read(b, 50)] == list(range(100, 150))
        # A malformed frame is counted and dropped; the next delta still arrives.
        raw: zmq.Socket = zmq.Context.instance().socket(zmq.PUSH)
        raw.connect(inbox.address)
        raw.send(b"\x80\x04not a delta")
        for _ in range(100):
            if inbox.num_malformed:
                break
            await asyncio.sleep(0.01)
        outbox.send(inbox.address, delta("a", 7, "stop"))
        assert [d.token_ids for d in await read(a, 1)] == [[7]] and inbox.num_malformed == 1
        assert a.empty() and b.empty() and inbox.num_open == 2
        inbox.close("a")
        inbox.close("b")
        assert inbox.num_open == 0
        raw.close()
        outbox.close()
        other.close()
        await inbox.stop()
    asyncio.run(body())


def test_with_the_cluster_keys_only_a_keyed_worker_gets_through() -> None:
    async def body() -> None:
        keys = CurveKeys.from_secret(SECRET)
        inbox = DeltaInbox(keys=keys)
        inbox.start()
        queue = inbox.open("r")
        other = CurveKeys.from_secret("another secret, another cluster")
        strangers = [DeltaOutbox(),  # no keys: no handshake at all
                     # The server's public key, but a client key of its own: the inbox refuses it.
                     DeltaOutbox(dataclasses.replace(keys, client_public=other.client_public,
                                                     client_secret=other.client_secret))]
        for stranger in strangers:
            stranger.send(inbox.address, delta("r", 1))
        worker = DeltaOutbox(keys)
        worker.send(inbox.address, delta("r", 2, "stop"))
        assert [d.token_ids for d in await read(queue, 1)] == [[2]]
        await asyncio.sleep(0.3)
        assert queue.empty() and inbox.num_denied >= 1
        for stranger in strangers:
            stranger.close()
        worker.close()
        await inbox.stop()
    asyncio.run(body())


@pytest.fixture(autouse=True)
def no_ray(monkeypatch):
    """A stream left early is cancelled with ray.cancel, which would start a local Ray for
    these fakes: a no-op instead."""
    monkeypatch.setattr(worker_stream.ray, "cancel", lambda call: None)


class Streamer:
    """A worker's streaming method: .remote(inbox) sends ``script``'s deltas (each after its
    delay) to the inbox and returns after ``returns_after`` of them (or raises ``error``)."""

    def __init__(self, script: list[tuple[float, StreamDelta]], returns_after: int, error: BaseException | None = None):
        self.script, self.returns_after, self.error = script, returns_after, error
        self.outbox = DeltaOutbox()
        self.rest: asyncio.Task | None = None

    def remote(self, inbox: str):
        async def send(script) -> None:
            for delay, d in script:
                await asyncio.sleep(delay)
                self.outbox.send(inbox, d)

        async def call() -> None:
            await send(self.script[:self.returns_after])
            self.rest = asyncio.get_running_loop().create_task(send(self.script[self.returns_after:]))
            if self.error is not None:
                raise self.error
        return call()


def follow(streamer: Streamer) -> tuple[list[StreamDelta], BaseException | None, list[str], list[str]]:
    """-> (deltas yielded, the error the stream ended with, aborts sent, workers marked down)."""
    aborts: list[str] = []
    handle = Handle(lambda: None)
    def abort(request_id: str) -> bool:
        aborts.append(request_id)
        return True
    handle.abort = Method(abort)
    worker = WorkerState("d-0", handle)
    down: list[str] = []
    streams = WorkerStreams(WorkerCalls(), lambda w, why: down.append(w.instance))
    request = WorkerRequest("w-1", [1, 2, 3], SamplingParams())

    async def body() -> tuple[list[StreamDelta], BaseException | None]:
        got: list[StreamDelta] = []
        try:
            async for d in streams.follow(worker, streamer.remote, request, [worker]):
                got.append(d)
        except Exception as e:  # noqa: BLE001 - the test looks at it
            return got, e
        finally:
            assert streams.inbox.num_open == 0
            await streams.inbox.stop()
        return got, None
    got, error = asyncio.run(body())
    return got, error, aborts, down


def test_deltas_still_on_the_wire_when_the_call_returned_are_read() -> None:
    script = [(0.0, delta("w-1", 1)), (0.2, delta("w-1", 2)), (0.2, delta("w-1", 3, "length"))]
    got, error, aborts, down = follow(Streamer(script, returns_after=1))
    assert error is None and [t for d in got for t in d.token_ids] == [1, 2, 3] and got[-1].request_finished
    assert aborts == [] and down == []


def test_a_call_that_fails_ends_the_stream_and_marks_its_worker_down() -> None:
    script = [(0.0, delta("w-1", 1)), (0.5, delta("w-1", 2, "length"))]
    got, error, aborts, down = follow(Streamer(script, returns_after=1, error=RayActorError()))
    assert isinstance(error, RayActorError) and [t for d in got for t in d.token_ids] in ([], [1])
    assert aborts == ["w-1"] and down == ["d-0"]


def test_a_last_delta_that_never_comes_ends_the_stream_after_the_timeout(monkeypatch) -> None:
    monkeypatch.setattr(worker_stream, "LAST_DELTAS_TIMEOUT_S", 0.3)
    got, error, aborts, down = follow(Streamer([(0.0, delta("w-1", 1))], returns_after=1))
    assert isinstance(error, WorkerFailed) and "never came" in str(error)
    assert [t for d in got for t in d.token_ids] == [1] and aborts == ["w-1"] and down == []
