"""tandem bench lone: its parts that decide figures (the timing itself is the benchmark's)."""

from __future__ import annotations

import os
import threading

import pytest

from tandem.bench.lone import env_variants, report, worker_threads
from tandem.bench.serving.served_process import SERVING
from tandem.bench.serving.thread_cpu import ThreadKey, cpu_by_thread, snapshot


def test_env_variants_put_the_plain_setup_first_and_refuse_malformed_ones() -> None:
    assert env_variants(["nice0:A=1,B=x=y"]) == {"": {}, "nice0": {"A": "1", "B": "x=y"}}
    for bad in ("nothing", ":A=1", "label:", "label:A"):
        with pytest.raises(ValueError):
            env_variants([bad])


def test_the_streaming_workers_threads_are_the_serve_commands() -> None:
    assert worker_threads("colocated", 2, []) == 2
    assert worker_threads("disaggregated", 2, []) == 1
    assert worker_threads("disaggregated", 2, ["--num-threads", "2"]) == 2
    assert worker_threads("colocated", 4, ["--num-threads=1"]) == 1


def test_the_serving_line_of_tandem_serve_gives_its_address() -> None:
    line = "tandem: serving SmolLM2-135M-Instruct on 127.0.0.1:43211 (gRPC tandem.v1.Generation)"
    match = SERVING.search(line)
    assert match is not None and (match.group(1), match.group(2)) == ("127.0.0.1", "43211")


def test_cpu_by_thread_sums_threads_of_one_name_and_leaves_idle_ones_out() -> None:
    before = {ThreadKey("router", 1, "python#1"): 10, ThreadKey("router", 1, "io#2"): 5,
              ThreadKey("router", 1, "io#3"): 0, ThreadKey("router", 1, "idle#4"): 7}
    after = {ThreadKey("router", 1, "python#1"): 30, ThreadKey("router", 1, "io#2"): 6,
             ThreadKey("router", 1, "io#3"): 4, ThreadKey("router", 1, "idle#4"): 7,
             ThreadKey("router", 1, "new#5"): 1}
    rows = cpu_by_thread(before, after)
    ticks = {name: s * os.sysconf("SC_CLK_TCK") for _, name, s in rows}
    assert [name for _, name, _ in rows] == ["python", "io", "new"]
    assert ticks == pytest.approx({"python": 20, "io": 5, "new": 1})


def test_a_snapshot_sees_this_process_threads_by_their_os_names() -> None:
    done = threading.Event()
    worker = threading.Thread(target=done.wait)
    worker.start()
    try:
        ticks = snapshot({os.getpid(): "me"})
    finally:
        done.set()
        worker.join()
    assert sum(1 for key in ticks if key.pid == os.getpid() and key.label == "me") >= 2


def test_the_report_gives_each_served_run_its_ratio_to_the_bare_run_before_it(capsys) -> None:
    runs = [{"round": 0, "setup": "colocated", "threads": 2, "tpot_ms": 11.0, "tokens_per_message": 1.5,
             "bare_ms": {"1": 20.0, "2": 10.0}, "bare_others_cpu": {"2": 0.0}, "others_cpu": 0.02, "busiest": []},
            {"round": 1, "setup": "colocated", "threads": 2, "tpot_ms": 24.0, "tokens_per_message": 1.0,
             "bare_ms": {"1": 40.0, "2": 20.0}, "bare_others_cpu": {"2": 0.0}, "others_cpu": 0.0, "busiest": []}]
    report(runs, 2, ["colocated"])
    out = capsys.readouterr().out
    assert "1.10x" in out and "1.20x" in out
    assert "median over 2 round(s): 1.15x" in out


def test_the_summary_leaves_out_pairs_that_other_processes_disturbed(capsys) -> None:
    runs = [{"round": 0, "setup": "colocated", "threads": 2, "tpot_ms": 11.0, "tokens_per_message": 1.0,
             "bare_ms": {"2": 10.0}, "bare_others_cpu": {"2": 0.0}, "others_cpu": 0.0, "busiest": []},
            {"round": 1, "setup": "colocated", "threads": 2, "tpot_ms": 15.0, "tokens_per_message": 1.0,
             "bare_ms": {"2": 200.0}, "bare_others_cpu": {"2": 0.6}, "others_cpu": 0.4, "busiest": []}]
    report(runs, 2, ["colocated"])
    out = capsys.readouterr().out
    assert "median over 1 round(s): 1.10x" in out and "1 run(s) left out" in out
