"""One engine stepped on a thread of its own, driven from asyncio (a worker's actor methods).

NOTE: only the loop thread touches the engine (and a worker's transfer sockets): other
threads hand it work with `submit`, and it hands deltas out through `open_stream`'s streams
(delta_stream.py: sent to their reader on the loop thread itself).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from typing import Any, Callable

from tandem.engine.engine import LLMEngine
from tandem.outputs import RequestDelta
from tandem.worker.api import EngineDown, StreamDelta
from tandem.worker.delta_stream import DeltaStream
from tandem.worker.heartbeat_file import HeartbeatFile
from tandem.worker.step_priority import ENGINE_THREAD, name_os_thread

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.002  # how often an idle loop still ticks (transfer events, deadlines)
IDLE_REST_S = 0.05
"""How often an idle loop ticks when its worker has nothing in flight (see ``idle_wait``):
a command wakes it at once, and its polling would take CPU from a busy worker beside it."""


def stream_delta(d: RequestDelta, error: str | None = None) -> StreamDelta:
    return StreamDelta(d.request_id, d.new_token_ids, d.new_text,
                       None if d.finish_reason is None else d.finish_reason.value,
                       d.num_prompt_tokens, d.num_output_tokens, d.new_logprobs, d.new_top_logprobs, error, d.index,
                       d.num_unfinished, d.num_cached_tokens)


class EngineLoop:
    def __init__(self, engine: LLMEngine, tick: Callable[[], None] | None = None,
                 on_down: Callable[[EngineDown], None] | None = None,
                 idle_wait: Callable[[], float] | None = None) -> None:
        """tick: runs every iteration, busy or idle (transfer events). What runs inside a step
        is the engine's (see PrefillHooks). on_down: called on the loop thread, after every
        open stream got its error, when the loop stopped on an error (see `down`). idle_wait:
        on the loop thread, how long an idle loop waits for a command before it ticks again
        (default IDLE_WAIT_S)."""
        self.engine = engine
        self._tick = tick
        self._idle_wait = idle_wait
        self._on_down = on_down
        self.down: EngineDown | None = None
        """Why the loop stopped on an error; from then on every call fails with it."""
        self._commands: queue.Queue[tuple[Callable[[LLMEngine], Any], concurrent.futures.Future]] = queue.Queue()
        self._streams: dict[str, DeltaStream] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._last_iteration_at = time.monotonic()
        self.heartbeat_file: HeartbeatFile | None = None
        """Touched as the loop goes round, for a probe outside the process (see heartbeat_file.py)."""
        self._thread = threading.Thread(target=self._run, name=ENGINE_THREAD, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        """Run fn(engine) on the loop thread between steps. -> its result, as a future."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self.down is not None:
            future.set_exception(self.down)
            return future
        self._commands.put((fn, future))
        self._wake.set()
        return future

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        return await asyncio.wrap_future(self.submit(fn))

    def open_stream(self, request_id: str) -> DeltaStream:
        """Deltas of `request_id` from now on, held until their reader binds to the stream.
        Raises ValueError when the id has a stream already (it belongs to another call)."""
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream = self._streams[request_id] = DeltaStream(request_id)
        return stream

    def stream(self, request_id: str) -> DeltaStream:
        """The stream `open_stream` made for a request; KeyError when there is none."""
        return self._streams[request_id]

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    @property
    def num_streams(self) -> int:
        """Streams open now (a worker at rest has none: see WorkerInventory)."""
        return len(self._streams)

    def publish(self, delta: StreamDelta) -> None:
        """Hand a delta to its stream (any thread; the loop thread's deltas go out on it)."""
        stream = self._streams.get(delta.request_id)
        if stream is not None:
            stream.put(delta)

    def publish_engine_delta(self, d: RequestDelta, error: str | None = None) -> None:
        self.publish(stream_delta(d, error))

    @property
    def native_id(self) -> int | None:
        """The loop thread's id in the OS (its OpenMP team's threads are started from it)."""
        return self._thread.native_id

    def seconds_since_iteration(self) -> float:
        """How long ago the loop thread last went round (any thread): it goes round every
        IDLE_WAIT_S when idle, after every step when busy; a large value means it is stuck."""
        return time.monotonic() - self._last_iteration_at

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join()

    def _run(self) -> None:
        name_os_thread(self._thread.name)
        try:
            self._loop()
        except BaseException as e:  # noqa: BLE001 - whatever it was, the engine is unusable now
            logger.exception("the engine loop stopped on an error")
            self._stop_on(EngineDown(f"the worker's engine stopped on an error: {type(e).__name__}: {e}"[:300]))

    def _stop_on(self, down: EngineDown) -> None:
        """Fail every open stream and every call, queued or to come, with `down`."""
        self.down = down
        while not self._commands.empty():
            _, future = self._commands.get_nowait()
            if future.set_running_or_notify_cancel():
                future.set_exception(down)
        for request_id in list(self._streams):
            self.publish(StreamDelta(request_id, [], "", "abort", 0, 0, error=str(down)))
        if self._on_down is not None:
            self._on_down(down)

    def _loop(self) -> None:
        engine = self.engine
        while not self._stop.is_set():
            self._last_iteration_at = time.monotonic()
            if self.heartbeat_file is not None:
                self.heartbeat_file.beat(self._last_iteration_at)
            # NOTE: only the commands already queued: callers that keep submitting (a flood of
            # reservations) must not hold the step back.
            for _ in range(self._commands.qsize()):
                fn, future = self._commands.get_nowait()
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(engine))
                    except BaseException as e:  # the caller gets it
                        future.set_exception(e)
            if self._tick is not None:
                self._tick()
            if engine.has_unfinished:
                for d in engine.step():
                    self.publish_engine_delta(d)
            else:
                self._wake.wait(IDLE_WAIT_S if self._idle_wait is None else self._idle_wait())
                self._wake.clear()
