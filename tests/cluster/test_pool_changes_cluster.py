"""The disaggregated cluster's pools changed while it serves the mix (mixed_streams.py) at a
steady rate, every request ending OK and equal, per completion, to its uninterrupted run:
decode scaled 1 -> 2 -> 1 with tandem scale and tandem drain, the same by the autoscaler, and
a rolling restart of every worker (tandem restart). Drained workers end for good (Ray does not
restart them) and nothing leaks.

NOTE: these tests replace the shared cluster's workers, which the "local" router holds by
handle: conftest.py runs this module after every other that uses the clusters."""

from __future__ import annotations

import json
import os
import time

import pytest
import ray
from fault_calls import wait_until
from metrics_text import parse_samples, total
from mixed_streams import SteadyLoad, assert_steady_equal, decode_running, migrations
from worker_checks import assert_workers_empty, num_leaked_blocks

from tandem import cli
from tandem.router.autoscale import AutoscaleConfig, PoolBounds, SloWindow
from tandem.router.autoscaler import Autoscaler
from tandem.worker.api import Role

pytestmark = pytest.mark.slow

ROLLING_RESTART_S = float(os.environ.get("TANDEM_ROLLING_RESTART_S", "0"))
"""How long the rolling restart's load lasts at least (the fault table's full row: 120); by
default, as long as the restart takes, and 3 s more."""


def decode_changes(cluster) -> tuple[float, float]:
    """tandem_pool_changes_total of the decode pool so far: (added, drained)."""
    samples = parse_samples(cluster.scrape())
    name = "tandem_pool_changes_total"
    return total(samples, name, pool="decode", change="added"), total(samples, name, pool="decode", change="drained")


def assert_ended_for_good(handle) -> None:
    with pytest.raises(ray.exceptions.RayActorError):  # Ray did not restart it
        ray.get(handle.heartbeat.remote(), timeout=30)


def admin(capsys, *args: str) -> dict:
    """A tandem admin command that succeeds -> its JSON answer."""
    capsys.readouterr()
    assert cli.main(list(args)) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_decode_scaled_1_to_2_to_1_under_load(clusters, tokenizer, reference, fault_report, capsys):
    cluster = clusters["disaggregated"]
    backend = cluster.backend
    url = cluster.openai_url().removesuffix("/v1")
    changes_before = decode_changes(cluster)
    admin(capsys, "drain", backend.decode[-1].instance, "--url", url, "--timeout-s", "5")  # the row starts at 1
    assert len(backend.decode) == 1
    capsys.readouterr()
    assert cli.main(["drain", backend.decode[0].instance, "--url", url]) == 1  # it would empty the pool
    assert "without a worker" in capsys.readouterr().err
    before = migrations(cluster)
    with SteadyLoad(cluster, tokenizer, rate_per_s=2) as load:
        wait_until(lambda: len(load.outs) >= 4, 30, "the load runs")
        started = time.monotonic()
        scaled = admin(capsys, "scale", "--decode", "2", "--url", url)
        add_s = time.monotonic() - started
        (added,) = [w for w in backend.decode if f"added {w.instance}" in scaled["changes"]]
        wait_until(lambda: decode_running(cluster).get(added.instance, 0) >= 2, 60, "the new worker takes its share")
        drained = admin(capsys, "drain", added.instance, "--url", url, "--timeout-s", "1")
        time.sleep(2)  # the load goes on, on one worker again
    assert_steady_equal(reference, load.outs)
    num_moved, added_s = (b - a for a, b in zip(before, migrations(cluster)))
    assert drained["num_moved"] > 0 and num_moved >= drained["num_moved"], (drained, num_moved)
    assert len(backend.decode) == 1 and added not in backend.workers
    assert_ended_for_good(added.handle)
    assert [b - a for a, b in zip(changes_before, decode_changes(cluster))] == [1, 2]  # added 1, drained 2
    assert_workers_empty(cluster, timeout=30)
    held = drained["num_at_start"]
    fault_report.add("decode scaled 1 -> 2 -> 1 under load", injected=2, affected=held, clear=held,
                     leaked=num_leaked_blocks(cluster), recovery_s=add_s,
                     note=f"{len(load.outs)} mixed streams at 2 req/s; tandem scale --decode 2 added {added.instance} "
                          f"in {add_s:.1f} s (its model load); holding {held}, tandem drain --timeout-s 1 moved "
                          f"{drained['num_moved']} ({int(num_moved)} completions, adding {added_s / num_moved:.2f} s "
                          f"each on average) in {drained['seconds']:.1f} s; all OK and equal to the uninterrupted "
                          "run; recovery = the added worker's start")


def test_the_autoscaler_adds_a_decode_worker_under_load_and_drains_it_when_idle(clusters, tokenizer, reference):
    """decode=1:2, an SLO of 1 ms per output token (missed by every request: pressure): a worker
    is added once the pressure has held 1 s; once the load is gone and the window (2 s) empty,
    the pool idles 2 s and the autoscaler drains the worker it added."""
    cluster = clusters["disaggregated"]
    backend = cluster.backend
    [original] = [w.instance for w in backend.decode]
    config = AutoscaleConfig({Role.DECODE: PoolBounds(1, 2)}, up_after_s=1, down_after_s=2, cooldown_s=2)

    async def start() -> Autoscaler:
        scaler = Autoscaler(backend.pool_changes, config, SloWindow(60.0, 0.001, window_s=2), every_s=0.5,
                            drain_timeout_s=5)
        backend.metrics.slo_window = scaler.slo
        scaler.start()
        return scaler

    scaler = cluster.run(start())
    try:
        with SteadyLoad(cluster, tokenizer, rate_per_s=2) as load:
            wait_until(lambda: scaler.changes_made, 120, "the autoscaler adds a decode worker")
            [added] = scaler.changes_made
            name = added.removeprefix("added ")
            wait_until(lambda: decode_running(cluster).get(name, 0) > 0, 60, "the new worker serves")
        wait_until(lambda: len(scaler.changes_made) == 2, 120, "the autoscaler drains it once the pool idles")
    finally:
        cluster.run(scaler.stop())
        backend.metrics.slo_window = None
    assert scaler.changes_made == [f"added {name}", f"drained {name}"]
    assert [w.instance for w in backend.decode] == [original]
    assert_steady_equal(reference, load.outs)
    assert_workers_empty(cluster, timeout=30)


def test_a_rolling_restart_of_every_worker_fails_nothing(clusters, tokenizer, reference, fault_report, capsys):
    cluster = clusters["disaggregated"]
    backend = cluster.backend
    url = cluster.openai_url().removesuffix("/v1")
    old = list(backend.workers)
    sizes = (len(backend.prefill), len(backend.decode))
    before = migrations(cluster)
    with SteadyLoad(cluster, tokenizer, rate_per_s=1) as load:
        began = time.monotonic()
        time.sleep(2)
        restarted = admin(capsys, "restart", "--url", url, "--drain-timeout-s", "2")
        restart_s = time.monotonic() - began - 2
        time.sleep(max(3.0, ROLLING_RESTART_S - (time.monotonic() - began)))
    load_s = time.monotonic() - began
    assert_steady_equal(reference, load.outs)
    assert [c.split()[0] for c in restarted["changes"]] == ["added", "drained"] * len(old)
    assert [f"drained {w.instance}" for w in old] == restarted["changes"][1::2]
    assert not {w.instance for w in backend.workers} & {w.instance for w in old}
    assert (len(backend.prefill), len(backend.decode)) == sizes
    for w in old:
        assert_ended_for_good(w.handle)
    num_moved, _ = (b - a for a, b in zip(before, migrations(cluster)))
    assert_workers_empty(cluster, timeout=30)
    fault_report.add("rolling restart of every worker at 1 req/s", injected=len(old), affected=int(num_moved),
                     clear=int(num_moved), leaked=num_leaked_blocks(cluster), recovery_s=restart_s,
                     note=f"tandem restart replaced {', '.join(w.instance for w in old)} (each: a new worker "
                          f"started, then the old one drained, --drain-timeout-s 2) in {restart_s:.1f} s under "
                          f"{len(load.outs)} mixed streams over {load_s:.0f} s; {int(num_moved)} completions moved; "
                          "all OK and equal to the uninterrupted run")
