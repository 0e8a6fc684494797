"""A log line per pool every STATS_EVERY_S, as vLLM's: prompt and generation throughput over
the interval, requests running and waiting, KV cache usage and the prefix cache hit rate, from
the loads the router polls anyway (no extra call to any worker)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from tandem.worker.api import Role, WorkerLoad

logger = logging.getLogger(__name__)

STATS_EVERY_S = 10.0


class PoolStats:
    """Turns successive snapshots of every worker's load into one line per pool."""

    def __init__(self) -> None:
        self._last: dict[str, WorkerLoad] = {}
        self._last_at: float | None = None

    def lines(self, loads: Iterable[WorkerLoad], now: float) -> list[str]:
        """-> a line per pool that did anything since the last call (none the first time)."""
        loads = list(loads)
        seconds = None if self._last_at is None else max(now - self._last_at, 1e-9)
        lines = []
        for role in Role:
            pool = [w for w in loads if w.role is role]
            if not pool or seconds is None:
                continue
            def delta(read: Callable[[WorkerLoad], int]) -> int:
                # A worker seen for the first time (or restarted, its counts back at 0) counts from 0.
                return sum(max(0, read(w) - (read(self._last[w.instance]) if w.instance in self._last else 0))
                           for w in pool)
            prompt, generated = delta(lambda w: w.num_prompt_tokens), delta(lambda w: w.num_generated_tokens)
            running, waiting = sum(w.num_running for w in pool), sum(w.num_waiting for w in pool)
            if not (prompt or generated or running or waiting):
                continue
            queries, hits = delta(lambda w: w.num_prefix_queries), delta(lambda w: w.num_prefix_hits)
            blocks = sum(w.num_blocks for w in pool)
            used = 1 - sum(w.num_free_blocks for w in pool) / blocks if blocks else 0.0
            # A decode worker's "prompt" tokens are the ones it received as KV: not computed there.
            prompt_part = "" if role is Role.DECODE else f"prompt throughput {prompt / seconds:.1f} tokens/s, "
            lines.append(f"{role.value} pool ({len(pool)} worker{'s' if len(pool) > 1 else ''}): {prompt_part}"
                         f"generation throughput {generated / seconds:.1f} tokens/s, running {running}, "
                         f"waiting {waiting}, KV cache usage {100 * used:.1f}%, "
                         f"prefix cache hit rate {100 * hits / queries if queries else 0.0:.1f}%")
        self._last = {w.instance: w for w in loads}
        self._last_at = now
        return lines


async def log_pool_stats(current_loads: Callable[[], Iterable[WorkerLoad]], every_s: float = STATS_EVERY_S) -> None:
    """Log PoolStats' lines every `every_s` seconds, until cancelled."""
    stats = PoolStats()
    while True:
        for line in stats.lines(current_loads(), time.monotonic()):
            logger.info("%s", line)
        await asyncio.sleep(every_s)
