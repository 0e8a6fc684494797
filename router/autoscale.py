"""When to add or remove a worker of a pool: the pure decision part of the router's autoscaler.

No Ray, no asyncio, no clock: the caller measures each pool (PoolSignal), passes the time
(``now``, seconds on a monotonic clock), acts on the ScaleStep it gets, and says when a change
began (AutoscalePolicy.changed). The rules are AutoscalePolicy's docstring."""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

from tandem.worker.api import Role


@dataclass(frozen=True)
class PoolBounds:
    """The fewest and most workers a pool may have."""

    min: int
    max: int

    def __post_init__(self) -> None:
        # bool is an int subclass; True as a worker count is a bug, not a bound.
        if type(self.min) is not int or type(self.max) is not int:
            raise ValueError(f"pool bounds must be ints, got min={self.min!r} max={self.max!r}")
        if not 1 <= self.min <= self.max:
            raise ValueError(f"pool bounds need 1 <= min <= max, got min={self.min} max={self.max}")


def parse_pool_bounds(text: str) -> tuple[Role, PoolBounds]:
    """A CLI value ``POOL=MIN:MAX`` (e.g. ``decode=1:4``) as the pool and its bounds; ValueError otherwise."""
    pools = ", ".join(role.value for role in Role)
    name, sep, span = text.partition("=")
    if not sep:
        raise ValueError(f"pool bounds {text!r}: expected POOL=MIN:MAX, e.g. decode=1:4")
    try:
        role = Role(name.strip())
    except ValueError:
        raise ValueError(f"pool bounds {text!r}: unknown pool {name.strip()!r} (one of {pools})") from None
    low, sep, high = span.partition(":")
    if not sep:
        raise ValueError(f"pool bounds {text!r}: expected MIN:MAX after '=', e.g. {role.value}=1:4")
    try:
        bounds = (int(low.strip()), int(high.strip()))
    except ValueError:
        raise ValueError(f"pool bounds {text!r}: MIN and MAX must be integers") from None
    try:
        return role, PoolBounds(*bounds)
    except ValueError as error:
        raise ValueError(f"pool bounds {text!r}: {error}") from None


@dataclass(frozen=True)
class PoolSignal:
    """What the router measured for one pool over the last window."""

    role: Role
    """The pool."""
    num_workers: int
    """Routable workers in the pool (not those starting or draining)."""
    num_waiting: int
    """Requests waiting in the queues of the pool's workers, summed."""
    num_running: int
    """Requests the pool's workers are running, summed."""
    kv_usage: float
    """Used fraction (0..1) of the pool's KV cache blocks, all workers together."""
    slo_attainment: float | None
    """Fraction (0..1) of the requests finished in the window that met the pool's SLO
    (SloWindow.attainment); None when none finished."""

    def __post_init__(self) -> None:
        if min(self.num_workers, self.num_waiting, self.num_running) < 0:
            raise ValueError(f"pool signal counts must be >= 0: {self}")
        if not 0.0 <= self.kv_usage <= 1.0:
            raise ValueError(f"pool signal kv_usage must be in [0, 1], got {self.kv_usage}")
        if self.slo_attainment is not None and not 0.0 <= self.slo_attainment <= 1.0:
            raise ValueError(f"pool signal slo_attainment must be in [0, 1] or None, got {self.slo_attainment}")


class SloWindow:
    """Finished requests' latencies over the last ``window_s`` seconds, and the fraction that
    met the SLO (time to first token, time per output token)."""

    def __init__(self, ttft_slo_s: float, tpot_slo_s: float, window_s: float = 30.0) -> None:
        for name, value in (("ttft_slo_s", ttft_slo_s), ("tpot_slo_s", tpot_slo_s), ("window_s", window_s)):
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"SloWindow {name} must be a positive number, got {value!r}")
        self.ttft_slo_s = ttft_slo_s
        self.tpot_slo_s = tpot_slo_s
        self.window_s = window_s
        self._entries: deque[tuple[float, float, float | None]] = deque()

    def record(self, at: float, ttft_s: float, tpot_s: float | None = None) -> None:
        """One request finished at ``at``; tpot_s None: it made at most one token."""
        self._entries.append((at, ttft_s, tpot_s))
        self._expire(at)

    def attainment(self, role: Role, now: float) -> float | None:
        """Fraction of the requests finished in (now - window_s, now] that met the SLO that
        matters to ``role``: PREFILL ttft, DECODE tpot (requests without one left out),
        COLOCATED both (no tpot counts as met). None when no request counts."""
        self._expire(now)
        met = total = 0
        for at, ttft, tpot in self._entries:
            if role is Role.PREFILL:
                ok = ttft <= self.ttft_slo_s
            elif role is Role.DECODE:
                if tpot is None:
                    continue
                ok = tpot <= self.tpot_slo_s
            else:
                ok = ttft <= self.ttft_slo_s and (tpot is None or tpot <= self.tpot_slo_s)
            total += 1
            met += ok
        return met / total if total else None

    def __len__(self) -> int:
        return len(self._entries)

    def _expire(self, now: float) -> None:
        # Entries arrive in time order, so the old ones are all at the left.
        while self._entries and self._entries[0][0] <= now - self.window_s:
            self._entries.popleft()


@dataclass(frozen=True)
class AutoscaleConfig:
    """The autoscaler's bounds and thresholds (times in seconds)."""

    bounds: Mapping[Role, PoolBounds]
    """Pools the autoscaler manages; a pool not named here is never changed."""
    up_after_s: float = 10.0
    """Pressure must last this long before a worker is added."""
    down_after_s: float = 60.0
    """Idleness must last this long before a worker is removed (>= up_after_s: hysteresis)."""
    cooldown_s: float = 30.0
    """After any change to a pool, no further change to it for this long."""
    target_attainment: float = 0.9
    """SLO attainment below this is pressure."""
    kv_high: float = 0.8
    """KV usage at or above this is pressure (decode and colocated pools)."""
    kv_low: float = 0.3
    """A decode or colocated pool is idle when its KV would stay below this with one worker fewer."""
    waiting_per_worker_high: float = 1.0
    """Waiting requests per worker at or above this is pressure."""

    def __post_init__(self) -> None:
        if not self.bounds:
            raise ValueError("AutoscaleConfig.bounds must name at least one pool")
        for role, bounds in self.bounds.items():
            if not isinstance(role, Role) or not isinstance(bounds, PoolBounds):
                raise ValueError(f"AutoscaleConfig.bounds must map Role to PoolBounds, got {role!r}: {bounds!r}")
        # A private read-only copy: the caller's dict changing later must not change the policy.
        object.__setattr__(self, "bounds", MappingProxyType(dict(self.bounds)))
        if not 0 <= self.up_after_s <= self.down_after_s < math.inf or not 0 <= self.cooldown_s < math.inf:
            times = f"up_after_s={self.up_after_s} down_after_s={self.down_after_s} cooldown_s={self.cooldown_s}"
            raise ValueError(f"AutoscaleConfig needs 0 <= up_after_s <= down_after_s and cooldown_s >= 0, got {times}")
        if not 0 < self.target_attainment <= 1:
            raise ValueError(f"AutoscaleConfig.target_attainment must be in (0, 1], got {self.target_attainment}")
        if not 0 < self.kv_low < self.kv_high < 1:
            raise ValueError(f"AutoscaleConfig needs 0 < kv_low < kv_high < 1, got kv_low={self.kv_low} "
                             f"kv_high={self.kv_high}")
        if not 0 < self.waiting_per_worker_high < math.inf:
            raise ValueError(f"AutoscaleConfig.waiting_per_worker_high must be > 0, got {self.waiting_per_worker_high}")


class ScaleStep(enum.IntEnum):
    """What to do to a pool: remove a worker, nothing, or add one."""

    DOWN = -1
    HOLD = 0
    UP = 1


class AutoscalePolicy:
    """Decides, one pool signal at a time, whether each pool should grow or shrink.

    Pressure (any of): waiting requests per worker >= waiting_per_worker_high; KV usage >=
    kv_high (decode and colocated only: a prefill worker's KV lives only until it is sent);
    SLO attainment known and below target_attainment.

    Idle (all of): nothing waiting; attainment unknown or at target; the load fits in one
    worker fewer with room: for decode and colocated, kv_usage * n / (n - 1) < kv_low; for
    prefill, num_running <= n - 1 (a prefill worker runs about one prompt at a time).

    UP once pressure has held for up_after_s, DOWN once idleness has held for down_after_s,
    neither beyond the pool's bounds nor within cooldown_s of changed(). A pool outside its
    bounds is brought back at once, cooldown or not.
    """

    def __init__(self, config: AutoscaleConfig) -> None:
        self.config = config
        self._pressure_since: dict[Role, float] = {}
        self._idle_since: dict[Role, float] = {}
        self._changed_at: dict[Role, float] = {}
        self._reasons: dict[Role, str] = {}

    def decide(self, signal: PoolSignal, now: float) -> ScaleStep:
        """The step for ``signal``'s pool at time ``now``; reason() says why."""
        step, why = self._decide(signal, now)
        self._reasons[signal.role] = why
        if step is not ScaleStep.HOLD:
            self._reset(signal.role)
        return step

    def changed(self, role: Role, now: float) -> None:
        """A change to ``role``'s pool began at ``now``: its cooldown starts, and its timers
        start over (what was measured was about the pool's old size)."""
        self._changed_at[role] = now
        self._reset(role)

    def reason(self, role: Role) -> str:
        """Why the last decide() for ``role`` decided what it did, for logs."""
        return self._reasons.get(role, "no decision yet")

    def _decide(self, signal: PoolSignal, now: float) -> tuple[ScaleStep, str]:
        role, n = signal.role, signal.num_workers
        bounds = self.config.bounds.get(role)
        if bounds is None:
            return ScaleStep.HOLD, f"{role.value}: not autoscaled"
        if n < bounds.min:
            return ScaleStep.UP, f"{role.value}: {n} workers, below min {bounds.min}"
        if n > bounds.max:
            return ScaleStep.DOWN, f"{role.value}: {n} workers, above max {bounds.max}"
        pressure = self._pressure(signal)
        idle = self._idle(signal) if pressure is None else None
        # Each timer runs only while its condition holds without a break.
        for since, cause in ((self._pressure_since, pressure), (self._idle_since, idle)):
            if cause is None:
                since.pop(role, None)
            else:
                since.setdefault(role, now)
        since_change = now - self._changed_at.get(role, -math.inf)
        if pressure is not None:
            step, cause, held = ScaleStep.UP, pressure, now - self._pressure_since[role]
            wait, limit = self.config.up_after_s, f"max {bounds.max}" if n >= bounds.max else None
        elif idle is not None:
            step, cause, held = ScaleStep.DOWN, idle, now - self._idle_since[role]
            wait, limit = self.config.down_after_s, f"min {bounds.min}" if n <= bounds.min else None
        else:
            return ScaleStep.HOLD, f"{role.value}: steady"
        if limit is not None:
            return ScaleStep.HOLD, f"{role.value}: {cause}, but at {limit}"
        if held < wait:
            return ScaleStep.HOLD, f"{role.value}: {cause} for {held:.1f}s of {wait}s"
        if since_change < self.config.cooldown_s:
            return ScaleStep.HOLD, f"{role.value}: {cause}, but changed {since_change:.1f}s ago"
        return step, f"{role.value}: {cause} for {held:.1f}s"

    def _pressure(self, signal: PoolSignal) -> str | None:
        """What puts the pool under pressure, or None."""
        config, n = self.config, signal.num_workers
        if signal.num_waiting / n >= config.waiting_per_worker_high:
            return f"{signal.num_waiting} waiting on {n} workers"
        if signal.role is not Role.PREFILL and signal.kv_usage >= config.kv_high:
            return f"KV {signal.kv_usage:.0%} used"
        if signal.slo_attainment is not None and signal.slo_attainment < config.target_attainment:
            return f"SLO attainment {signal.slo_attainment:.0%}"
        return None

    def _idle(self, signal: PoolSignal) -> str | None:
        """Why the pool could do with one worker fewer, or None."""
        n = signal.num_workers
        if n <= 1 or signal.num_waiting:
            return None
        if signal.slo_attainment is not None and signal.slo_attainment < self.config.target_attainment:
            return None
        if signal.role is Role.PREFILL:
            fits = signal.num_running <= n - 1
            return f"{signal.num_running} prompts running on {n} workers" if fits else None
        fits = signal.kv_usage * n / (n - 1) < self.config.kv_low
        return f"KV {signal.kv_usage:.0%} used on {n} workers" if fits else None

    def _reset(self, role: Role) -> None:
        self._pressure_since.pop(role, None)
        self._idle_since.pop(role, None)
