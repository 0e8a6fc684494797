"""The HTTP front door bounds the bytes of bodies it receives, not just the calls: hundreds of
clients uploading maximum-size bodies, and slow uploads holding their share, cost the router
at most max_body_bytes_in_flight; the rest are refused at once (503), a slow upload ends at
body_read_timeout_s (408), and an ordinary client is served all along."""

from __future__ import annotations

import asyncio
import os
import threading
import time

from fake_backend import FakeBackend
from openai_harness import MODEL, openai_serving

from tandem.router.limits import RequestLimits

LIMITS = RequestLimits(max_prompt_chars=100_000, max_body_bytes_in_flight=10 * 2**20, body_read_timeout_s=1)
MAX_BODY = LIMITS.max_body_bytes  # 4 MiB: two fit in the budget, with room for small bodies
NUM_SLOW, NUM_FAST = 50, 150
CHUNK = memoryview(b"x" * 65536)
RSS_BOUND = 128 * 2**20
"""The most the process (router and clients) may grow: the 10 MiB budget, aiohttp's read
buffer of each of 200 connections, the allocator's slack. Measured: 60-70 MiB; 590 MiB with
the budget lifted (every body read)."""


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def upload(port: int, body_bytes: int, stall: bool) -> int:
    """POST a body declared MAX_BODY long: all of it at once, or its first bytes and then
    nothing. -> the response's status."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: tandem\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % body_bytes)
        try:
            # In pieces of one shared buffer: the clients, in this process too, hold little.
            for start in range(0, 1024 if stall else body_bytes, len(CHUNK)):
                writer.write(CHUNK[:body_bytes - start])
                await writer.drain()
        except ConnectionError:  # refused and closed before the body was all sent
            pass
        line = await asyncio.wait_for(reader.readline(), 30)
        return int(line.split()[1])
    finally:
        writer.close()


def test_hundreds_of_big_and_slow_bodies_stay_within_the_budget(router_tokenizer):
    peak = {"rss": 0}
    sampling = threading.Event()

    def sample(start: int) -> None:
        while not sampling.is_set():
            peak["rss"] = max(peak["rss"], rss_bytes() - start)
            time.sleep(0.01)

    async def body():
        async with openai_serving(FakeBackend(router_tokenizer), limits=LIMITS) as served:
            port = served.endpoint.port
            client = served.async_client()
            await client.completions.create(model=MODEL, prompt="warm", max_tokens=2)
            sampler = threading.Thread(target=sample, args=(rss_bytes(),))
            sampler.start()
            try:
                slow = [asyncio.create_task(upload(port, MAX_BODY, stall=True)) for _ in range(NUM_SLOW)]
                await asyncio.sleep(0.3)  # the slow ones hold the budget
                started = time.monotonic()
                fast = [asyncio.create_task(upload(port, MAX_BODY, stall=False)) for _ in range(NUM_FAST)]
                # An ordinary client meanwhile: its small body fits in what is left.
                served_ok = [(await client.completions.create(model=MODEL, prompt="hi", max_tokens=2)).choices[0].text
                             for _ in range(5)]
                ordinary_s = time.monotonic() - started
                return await asyncio.gather(*slow), await asyncio.gather(*fast), served_ok, ordinary_s
            finally:
                sampling.set()
                sampler.join()

    slow, fast, served_ok, ordinary_s = asyncio.run(body())
    # Two slow uploads fit the budget and time out; the rest were refused at once.
    assert sorted(slow).count(408) == 2 and slow.count(503) == NUM_SLOW - 2, sorted(slow)
    # The fast ones: refused while the budget was full, read (and refused as not JSON) after.
    assert set(fast) <= {503, 400} and fast.count(503) >= NUM_FAST // 2, sorted(fast)
    assert all(served_ok) and ordinary_s < 10
    assert peak["rss"] < RSS_BOUND, f"resident memory grew {peak['rss'] / 2**20:.0f} MiB"
