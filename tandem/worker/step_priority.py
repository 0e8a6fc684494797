"""The step first: on cores it shares with the serving path, the engine's step outranks it.

On a CPU host a worker's step and the serving path (Ray's threads streaming each token, the
actor's event loop, the router, gRPC) take turns on the same cores. Left alone, the step
loses every such contest:

- Ray starts each worker process at niceness 15 (``RAY_worker_niceness``), below the router
  and Ray's own daemons (niceness 0): whenever the serving path wants a core it takes it from
  the step, and a step thread that loses its core stalls every parallel region behind it.
- Inside the worker, Ray's threads and the actor's event loop run at the step's priority.

So a worker process keeps the niceness it was started with (``WORKER_ENV``, given to its Ray
actor), and the serving path's threads run ``SERVING_NICENESS`` below the step's: every thread
of a CPU worker but its engine loop (and the OpenMP team the loop starts, which inherits the
loop's name), and the router's threads in ``tandem serve``. The serving path then takes what
the step leaves, and the tokens that queue meanwhile leave together (``DeltaReader``): its work
per token shrinks exactly when it is short of CPU. Niceness only ever goes up here (lowering it
needs a privilege), and it only matters while the cores are contended.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

WORKER_ENV = {"RAY_worker_niceness": "0"}
"""A worker actor's environment: Ray leaves its niceness as it was started (Ray's default: 15)."""
SERVING_NICENESS = 10
"""How far below the step the serving path's threads run (CFS weights 1024 vs 110 at 0 vs 10)."""
ENGINE_THREAD = "engine-loop"
"""The OS name of the thread that steps the engine (EngineLoop names it; its OpenMP team inherits it)."""


def name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` in the OS too (Linux: what top -H and /proc show; 15
    bytes at most), so that the step's threads are told apart from the serving path's; the
    threads it starts later (the step's OpenMP team) inherit the name. A no-op where unsupported."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def actor_runtime_env() -> dict[str, dict[str, str]]:
    """The runtime_env option of an actor that steps an engine (a worker, a tensor-parallel rank)."""
    return {"env_vars": dict(WORKER_ENV)}


def thread_name(tid: int) -> str | None:
    """The OS name of thread ``tid`` of this process (None once it has ended)."""
    try:
        with open(f"/proc/self/task/{tid}/comm", encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def lower_threads(increment: int = SERVING_NICENESS, spare: str | None = None, spare_tid: int | None = None) -> int:
    """Raise the niceness of every thread of this process by ``increment``, except thread
    ``spare_tid`` and those named ``spare`` -> how many were changed. Threads they start later
    inherit it. A no-op (0) where /proc or setpriority is missing or refuses."""
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return 0
    changed = 0
    for tid in tids:
        if tid == spare_tid or (spare is not None and thread_name(tid) == spare):
            continue
        try:
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + increment))
            changed += 1
        except OSError:  # ended meanwhile, or not allowed: it keeps its priority
            pass
    return changed


def favour_the_step(engine_tid: int | None) -> None:
    """In a worker's process: its serving path's threads SERVING_NICENESS below the engine
    loop's (thread ``engine_tid``, and any thread named ENGINE_THREAD: its OpenMP team)."""
    changed = lower_threads(SERVING_NICENESS, spare=ENGINE_THREAD, spare_tid=engine_tid)
    logger.info("%d serving threads run %d below the engine loop's priority", changed, SERVING_NICENESS)
