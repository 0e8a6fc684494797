"""The autoscaler's decisions (router/autoscale.py): exact steps over sequences of signals and times."""

from __future__ import annotations

import math

import pytest

from tandem.router.autoscale import (
    AutoscaleConfig,
    AutoscalePolicy,
    PoolBounds,
    PoolSignal,
    ScaleStep,
    SloWindow,
    parse_pool_bounds,
)
from tandem.worker.api import Role

DOWN, HOLD, UP = ScaleStep.DOWN, ScaleStep.HOLD, ScaleStep.UP


def signal(role: Role = Role.DECODE, n: int = 2, waiting: int = 0, running: int = 0, kv: float = 0.5,
           attainment: float | None = None) -> PoolSignal:
    """Defaults: neither pressure nor idle (a decode pool of 2 at half its KV)."""
    return PoolSignal(role=role, num_workers=n, num_waiting=waiting, num_running=running, kv_usage=kv,
                      slo_attainment=attainment)


def policy(**bounds: tuple[int, int]) -> AutoscalePolicy:
    """up after 10 s, down after 60 s, cooldown 30 s (the defaults); decode 1:4 unless told."""
    pools = {Role(name): PoolBounds(*span) for name, span in (bounds or {"decode": (1, 4)}).items()}
    return AutoscalePolicy(AutoscaleConfig(bounds=pools))


def steps(scaler: AutoscalePolicy, samples: list[tuple[float, PoolSignal]]) -> list[ScaleStep]:
    return [scaler.decide(sample, now) for now, sample in samples]


PRESSURE = signal(waiting=4)  # 2 waiting per worker
CALM = signal()
IDLE = signal(n=3, kv=0.1)  # 0.1 * 3 / 2 = 0.15 < kv_low


def test_up_only_after_pressure_held_up_after_s():
    scaler = policy()
    assert scaler.reason(Role.DECODE) == "no decision yet"
    assert steps(scaler, [(t, PRESSURE) for t in (100.0, 105.0, 109.9)]) == [HOLD, HOLD, HOLD]
    assert "for 9.9s of 10.0s" in scaler.reason(Role.DECODE)
    assert scaler.decide(PRESSURE, 110.0) is UP
    assert "4 waiting on 2 workers" in scaler.reason(Role.DECODE)
    # decide() restarted the wait: no second UP at the next sample, one up_after_s later.
    assert steps(scaler, [(111.0, PRESSURE), (120.9, PRESSURE), (121.0, PRESSURE)]) == [HOLD, HOLD, UP]


def test_one_calm_sample_resets_the_wait():
    scaler = policy()
    samples = [(0.0, PRESSURE), (8.0, CALM), (9.0, PRESSURE), (15.0, PRESSURE), (18.9, PRESSURE), (19.0, PRESSURE)]
    assert steps(scaler, samples) == [HOLD, HOLD, HOLD, HOLD, HOLD, UP]


def test_flapping_load_changes_nothing():
    scaler = policy()
    samples = [(float(t), PRESSURE if t % 2 else IDLE) for t in range(0, 300, 5)]
    assert set(steps(scaler, samples)) == {HOLD}


def test_down_only_after_down_after_s_of_idleness():
    scaler = policy()
    assert steps(scaler, [(t, IDLE) for t in (0.0, 30.0, 59.9)]) == [HOLD, HOLD, HOLD]
    assert scaler.decide(IDLE, 60.0) is DOWN
    assert "KV 10% used on 3 workers" in scaler.reason(Role.DECODE)


def test_pressure_or_calm_resets_idleness():
    scaler = policy()
    samples = [(0.0, IDLE), (50.0, signal(n=3, waiting=3)), (51.0, IDLE), (100.0, IDLE), (110.9, IDLE),
               (111.0, IDLE)]
    assert steps(scaler, samples) == [HOLD, HOLD, HOLD, HOLD, HOLD, DOWN]
    scaler = policy()
    samples = [(0.0, IDLE), (50.0, signal(n=3, kv=0.2)), (51.0, IDLE), (110.9, IDLE), (111.0, IDLE)]
    assert steps(scaler, samples) == [HOLD, HOLD, HOLD, HOLD, DOWN]  # 0.2 * 3 / 2 = 0.3: not below kv_low


def test_cooldown_blocks_a_second_change():
    scaler = policy()
    assert steps(scaler, [(0.0, PRESSURE), (10.0, PRESSURE)]) == [HOLD, UP]
    scaler.changed(Role.DECODE, 10.0)
    still = signal(n=3, waiting=6)
    assert steps(scaler, [(11.0, still), (21.0, still), (39.9, still)]) == [HOLD, HOLD, HOLD]
    assert "changed 29.9s ago" in scaler.reason(Role.DECODE)
    assert scaler.decide(still, 40.0) is UP
    scaler.changed(Role.DECODE, 40.0)
    # Idle right after: the DOWN waits for both down_after_s and the cooldown (here the longer).
    idle = signal(n=4, kv=0.1)
    assert steps(scaler, [(41.0, idle), (100.9, idle), (101.0, idle)]) == [HOLD, HOLD, DOWN]


def test_cooldown_alone_holds_a_ready_down():
    scaler = AutoscalePolicy(AutoscaleConfig(bounds={Role.DECODE: PoolBounds(1, 4)}, up_after_s=0.0,
                                             down_after_s=0.0, cooldown_s=30.0))
    scaler.changed(Role.DECODE, 0.0)
    assert steps(scaler, [(0.0, IDLE), (29.9, IDLE), (30.0, IDLE)]) == [HOLD, HOLD, DOWN]


def test_never_above_max():
    scaler = policy(decode=(1, 2))
    assert set(steps(scaler, [(float(t), PRESSURE) for t in range(0, 200, 5)])) == {HOLD}
    assert "at max 2" in scaler.reason(Role.DECODE)


def test_never_below_min():
    scaler = policy(decode=(3, 4))
    assert set(steps(scaler, [(float(t), IDLE) for t in range(0, 500, 10)])) == {HOLD}
    assert "at min 3" in scaler.reason(Role.DECODE)


def test_outside_bounds_is_corrected_at_once_even_in_cooldown():
    scaler = policy(decode=(2, 3))
    scaler.changed(Role.DECODE, 0.0)
    assert scaler.decide(signal(n=1, kv=0.0), 1.0) is UP
    assert scaler.decide(signal(n=0, kv=0.0), 2.0) is UP
    assert "below min 2" in scaler.reason(Role.DECODE)
    assert scaler.decide(signal(n=4, waiting=100, kv=0.99), 3.0) is DOWN
    assert "above max 3" in scaler.reason(Role.DECODE)


def test_pool_without_bounds_always_holds():
    scaler = policy()
    samples = [(float(t), signal(Role.PREFILL, n=0 if t == 0 else 5, waiting=50)) for t in range(0, 100, 10)]
    assert set(steps(scaler, samples)) == {HOLD}
    assert "not autoscaled" in scaler.reason(Role.PREFILL)


def test_pools_are_timed_apart():
    scaler = policy(decode=(1, 4), prefill=(1, 4))
    assert scaler.decide(PRESSURE, 0.0) is HOLD
    assert scaler.decide(signal(Role.PREFILL, waiting=4), 5.0) is HOLD
    assert scaler.decide(PRESSURE, 10.0) is UP
    assert scaler.decide(signal(Role.PREFILL, waiting=4), 10.0) is HOLD
    assert scaler.decide(signal(Role.PREFILL, waiting=4), 15.0) is UP


def test_prefill_ignores_kv_usage():
    scaler = policy(prefill=(1, 4))
    full = signal(Role.PREFILL, running=1, kv=0.99)  # one prompt on two workers: idle, whatever its KV
    assert steps(scaler, [(0.0, full), (10.0, full), (59.9, full), (60.0, full)]) == [HOLD, HOLD, HOLD, DOWN]
    decode = policy()
    assert steps(decode, [(0.0, signal(kv=0.99)), (10.0, signal(kv=0.99))]) == [HOLD, UP]


def test_prefill_busy_with_a_prompt_per_worker_is_not_idle():
    scaler = policy(prefill=(1, 4))
    busy = signal(Role.PREFILL, running=2, kv=0.0)
    assert set(steps(scaler, [(float(t), busy) for t in range(0, 300, 10)])) == {HOLD}


def test_colocated_uses_kv_like_decode():
    scaler = policy(colocated=(1, 4))
    assert steps(scaler, [(0.0, signal(Role.COLOCATED, kv=0.8)), (10.0, signal(Role.COLOCATED, kv=0.8))]) == [HOLD, UP]
    idle = signal(Role.COLOCATED, n=3, kv=0.1)
    assert steps(scaler, [(100.0, idle), (160.0, idle)]) == [HOLD, DOWN]


def test_waiting_per_worker_threshold():
    scaler = policy()
    below = signal(n=3, waiting=2)  # 0.67 per worker
    assert steps(scaler, [(0.0, below), (100.0, below)]) == [HOLD, HOLD]
    at = signal(n=3, waiting=3)
    assert steps(scaler, [(200.0, at), (210.0, at)]) == [HOLD, UP]


def test_attainment_below_target_is_pressure():
    scaler = policy()
    missed = signal(attainment=0.85)
    assert steps(scaler, [(0.0, missed), (10.0, missed)]) == [HOLD, UP]
    assert "SLO attainment 85%" in scaler.reason(Role.DECODE)
    met = signal(attainment=0.9)
    assert steps(policy(), [(0.0, met), (100.0, met)]) == [HOLD, HOLD]


def test_missed_attainment_is_never_idle():
    missed = signal(n=3, kv=0.05, attainment=0.5)
    assert steps(policy(), [(0.0, missed), (10.0, missed)]) == [HOLD, UP]
    met = signal(n=3, kv=0.05, attainment=1.0)
    assert steps(policy(), [(0.0, met), (60.0, met)]) == [HOLD, DOWN]


def test_scale_steps_are_ordered():
    assert DOWN < HOLD < UP
    assert [int(step) for step in (DOWN, HOLD, UP)] == [-1, 0, 1]


def test_slo_window_attainment_per_role():
    window = SloWindow(ttft_slo_s=1.0, tpot_slo_s=0.1)
    window.record(10.0, ttft_s=0.5, tpot_s=0.05)  # meets both
    window.record(11.0, ttft_s=2.0, tpot_s=0.05)  # misses ttft
    window.record(12.0, ttft_s=0.5, tpot_s=0.2)  # misses tpot
    window.record(13.0, ttft_s=0.5, tpot_s=None)  # one token: no tpot
    assert window.attainment(Role.PREFILL, 13.0) == 3 / 4
    assert window.attainment(Role.DECODE, 13.0) == 2 / 3
    assert window.attainment(Role.COLOCATED, 13.0) == 2 / 4


def test_slo_window_none_when_nothing_counts():
    window = SloWindow(ttft_slo_s=1.0, tpot_slo_s=0.1)
    assert window.attainment(Role.PREFILL, 0.0) is None
    window.record(1.0, ttft_s=0.5)
    assert window.attainment(Role.DECODE, 1.0) is None
    assert window.attainment(Role.PREFILL, 1.0) == 1.0


def test_slo_window_drops_old_entries():
    window = SloWindow(ttft_slo_s=1.0, tpot_slo_s=0.1, window_s=30.0)
    window.record(0.0, ttft_s=5.0)  # a miss
    window.record(20.0, ttft_s=0.1)
    assert window.attainment(Role.PREFILL, 29.9) == 1 / 2
    assert window.attainment(Role.PREFILL, 30.0) == 1.0
    assert len(window) == 1
    assert window.attainment(Role.PREFILL, 50.0) is None
    assert len(window) == 0
    for t in range(1000):  # memory stays bounded by the window, not the history
        window.record(100.0 + t, ttft_s=0.1)
    assert len(window) == 30


@pytest.mark.parametrize("bad", [dict(ttft_slo_s=0.0, tpot_slo_s=0.1), dict(ttft_slo_s=1.0, tpot_slo_s=-1.0),
                                 dict(ttft_slo_s=1.0, tpot_slo_s=0.1, window_s=math.nan)])
def test_slo_window_rejects_bad_settings(bad):
    with pytest.raises(ValueError, match="SloWindow"):
        SloWindow(**bad)


def test_parse_pool_bounds():
    assert parse_pool_bounds("decode=1:4") == (Role.DECODE, PoolBounds(1, 4))
    assert parse_pool_bounds("prefill=2:2") == (Role.PREFILL, PoolBounds(2, 2))
    assert parse_pool_bounds(" colocated = 1 : 8 ") == (Role.COLOCATED, PoolBounds(1, 8))


@pytest.mark.parametrize("text, message", [
    ("decode", "expected POOL=MIN:MAX"), ("gpu=1:4", "unknown pool 'gpu' \\(one of prefill, decode, colocated\\)"),
    ("DECODE=1:4", "unknown pool"), ("decode=1-4", "expected MIN:MAX"), ("decode=4", "expected MIN:MAX"),
    ("decode=a:4", "must be integers"), ("decode=1.5:4", "must be integers"), ("decode=4:1", "1 <= min <= max"),
    ("decode=0:2", "1 <= min <= max"),
])
def test_parse_pool_bounds_rejects(text, message):
    with pytest.raises(ValueError, match=message):
        parse_pool_bounds(text)


@pytest.mark.parametrize("low, high", [(0, 1), (2, 1), (-1, 3), (True, 2), (1.0, 2)])
def test_pool_bounds_validated(low, high):
    with pytest.raises(ValueError, match="pool bounds"):
        PoolBounds(low, high)


@pytest.mark.parametrize("changes, message", [
    (dict(bounds={}), "at least one pool"),
    (dict(bounds={"decode": PoolBounds(1, 2)}), "map Role to PoolBounds"),
    (dict(up_after_s=30.0, down_after_s=10.0), "up_after_s <= down_after_s"),
    (dict(up_after_s=-1.0), "up_after_s <= down_after_s"),
    (dict(cooldown_s=-1.0), "cooldown_s >= 0"), (dict(cooldown_s=math.nan), "cooldown_s >= 0"),
    (dict(kv_low=0.8, kv_high=0.8), "kv_low < kv_high"), (dict(kv_low=0.0), "0 < kv_low"),
    (dict(kv_high=1.0), "kv_high < 1"), (dict(target_attainment=0.0), "target_attainment"),
    (dict(target_attainment=1.5), "target_attainment"), (dict(waiting_per_worker_high=0.0), "waiting_per_worker_high"),
])
def test_config_validated(changes, message):
    settings: dict = dict(bounds={Role.DECODE: PoolBounds(1, 2)})
    settings.update(changes)
    with pytest.raises(ValueError, match=message):
        AutoscaleConfig(**settings)


def test_config_keeps_its_own_bounds():
    bounds = {Role.DECODE: PoolBounds(1, 2)}
    config = AutoscaleConfig(bounds=bounds)
    bounds[Role.PREFILL] = PoolBounds(1, 2)
    assert dict(config.bounds) == {Role.DECODE: PoolBounds(1, 2)}


@pytest.mark.parametrize("changes", [dict(n=-1), dict(waiting=-1), dict(kv=1.5), dict(attainment=-0.1)])
def test_signal_validated(changes):
    with pytest.raises(ValueError, match="pool signal"):
        signal(**changes)
