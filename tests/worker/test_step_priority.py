"""step_priority: the serving path's threads go below the engine loop's, never the loop's own."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tandem.worker.step_priority import WORKER_ENV, actor_runtime_env

# Run in a process of its own: lowering threads here would slow the rest of the test run.
SCRIPT = textwrap.dedent("""
    import json, os, threading
    from tandem.worker.step_priority import ENGINE_THREAD, SERVING_NICENESS, favour_the_step, name_os_thread

    ready, done = threading.Event(), threading.Event()
    tids = {}

    def engine():
        name_os_thread(ENGINE_THREAD)
        tids["engine"] = threading.get_native_id()
        team = threading.Thread(target=lambda: (tids.__setitem__("team", threading.get_native_id()), done.wait()))
        team.start()  # as the loop's OpenMP team: started by the loop thread, named as it
        ready.wait()
        tids["team_after"] = os.getpriority(os.PRIO_PROCESS, tids["team"])
        done.wait()

    def serving():
        tids["serving"] = threading.get_native_id()
        done.wait()

    threads = [threading.Thread(target=engine), threading.Thread(target=serving)]
    for t in threads:
        t.start()
    while len(tids) < 3:
        pass
    # The loop thread spared by id (it may not have named itself yet), its team by name.
    favour_the_step(None)
    nice = {k: os.getpriority(os.PRIO_PROCESS, tids[k]) for k in ("engine", "team", "serving")}
    nice["main"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    ready.set()
    done.set()
    for t in threads:
        t.join()
    print(json.dumps({"nice": nice, "step": SERVING_NICENESS, "base": os.getpriority(os.PRIO_PROCESS, 0)}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread niceness and names through /proc")
def test_every_thread_but_the_engine_loops_goes_below_it() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    nice, step = result["nice"], result["step"]
    assert nice["engine"] == nice["team"]  # the step's threads keep their priority
    assert nice["serving"] == min(19, nice["engine"] + step)
    assert nice["main"] == min(19, nice["engine"] + step)


def test_actors_that_step_an_engine_keep_the_niceness_they_start_with() -> None:
    env = actor_runtime_env()
    assert env["env_vars"] == WORKER_ENV
    assert WORKER_ENV["RAY_worker_niceness"] == "0"  # Ray's default (15) would put the step below the router
