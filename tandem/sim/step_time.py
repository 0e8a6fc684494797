"""The CPU's step-time model: a piecewise-linear fit of real engine steps timed on this machine.

    step_s = a + b_small·P·[T <= L] + b_large·P·[T > L] + j·[T > L]
               + c·D + d·K + e·P²

P: prompt tokens computed, D: decoding sequences, K: KV tokens attended over, T = P + D the
step's rows. a: the step's fixed cost (scheduling, metadata, sampling, Python); b: a prompt
token through the weights; c: a decoded token through them, its LM head row and sampling;
d: a KV token attended over; e: a prompt chunk's causal attention over itself. L (the
fit's ``large_step_tokens``) is where the quantized product changes its way: on the CPU an
int4 weight is read in place by a GEMV kernel up to L = 160 rows and dequantized once a step
above (j: that one-off cost; a large step's token is then cheaper: b_large < b_small), so
one line through small and large steps misses both (measured: 18% median error against 8%).

The coefficients are fitted by least squares on relative errors (a 20 ms decode step counts
as much as a 1 s prefill), held non-negative, from steps that measure_steps.py times on the
real engine with the settings a ``tandem serve`` worker uses. The fit is kept as JSON under
the cache directory, with the machine, the model and the engine settings it holds for and
its error on held-out steps.

The GPU's model is roofline.py's (spec sheets, no measurement).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

FEATURES = ("constant", "prefill_tokens_small_step", "prefill_tokens_large_step", "large_step", "decode_seqs",
            "context_tokens", "prefill_tokens_squared")
"""The fit's terms, in the order of features()."""
FIT_FILE = "step_fit.json"
CACHE_ENV = "TANDEM_CACHE_DIR"
"""The cache directory's variable (as model/gguf_cache.py reads it: unset -> ~/.cache/tandem,
empty -> no cache)."""


@dataclass(frozen=True)
class StepSample:
    """One engine step as timed: its composition and its wall time."""

    num_prefill_tokens: int
    num_decode_seqs: int
    num_context_tokens: int
    seconds: float


def features(num_prefill_tokens: float, num_decode_seqs: float, num_context_tokens: float,
             large_step_tokens: int | None) -> list[float]:
    """One step's row of the fit (FEATURES' order); large_step_tokens None: no large steps."""
    p = float(num_prefill_tokens)
    large = large_step_tokens is not None and num_prefill_tokens + num_decode_seqs > large_step_tokens
    return [1.0, 0.0 if large else p, p if large else 0.0, 1.0 if large else 0.0, float(num_decode_seqs),
            float(num_context_tokens), p * p]


def nonnegative_least_squares(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """argmin ||a x - b|| over x >= 0, exactly: the best of the unconstrained least-squares
    fits over every subset of columns whose solution is non-negative (2^7 subsets here;
    scipy's Lawson-Hanson is not a dependency)."""
    n = a.shape[1]
    best, best_err = np.zeros(n), float(np.sum(b * b))
    for k in range(1, n + 1):
        for cols in itertools.combinations(range(n), k):
            sub, *_ = np.linalg.lstsq(a[:, cols], b, rcond=None)
            if np.any(sub < 0):
                continue
            x = np.zeros(n)
            x[list(cols)] = sub
            err = float(np.sum((a @ x - b) ** 2))
            if err < best_err - 1e-18:
                best, best_err = x, err
    return best


def relative_errors(model: CpuStepModel, samples: Sequence[StepSample]) -> np.ndarray:
    """(predicted - measured) / measured of each sample."""
    predicted = np.array([model.step_s(s.num_prefill_tokens, s.num_decode_seqs, s.num_context_tokens)
                          for s in samples])
    measured = np.array([s.seconds for s in samples])
    return (predicted - measured) / measured


def error_summary(errors: np.ndarray) -> dict[str, float]:
    """Absolute relative errors: mean, median, p90 and max."""
    e = np.abs(errors)
    return {"mean": float(e.mean()), "median": float(np.median(e)), "p90": float(np.percentile(e, 90)),
            "max": float(e.max()), "num_steps": int(e.size)}


def cache_root() -> Path | None:
    """tandem's cache directory (TANDEM_CACHE_DIR; None when set empty: caching off)."""
    root = os.environ.get(CACHE_ENV, os.path.join(os.path.expanduser("~"), ".cache", "tandem"))
    return Path(root) if root else None


def default_fit_path() -> Path:
    """Where the CPU fit is kept: step_fit.json in the cache directory."""
    root = cache_root()
    if root is None:
        raise ValueError(f"{CACHE_ENV} is empty (caching off): give the fit's path explicitly")
    return root / FIT_FILE


@dataclass
class CpuStepModel:
    """Step times of one model on this machine's CPU, fitted (a StepTimeModel, at tp 1)."""

    coefficients: dict[str, float]
    """Seconds per unit of each of FEATURES."""
    kv_bytes_per_token: int
    """KV bytes of one token over all layers, in the engine's KV dtype."""
    large_step_tokens: int | None = None
    """Rows above which a step's products take the large-step way (None: one way for all)."""
    meta: dict[str, Any] = field(default_factory=dict)
    """What the fit holds for: machine, model, dtype, quantization, threads, its errors; and,
    once calibrated against served runs (validate.calibrate), "serving": {"scale",
    "step_overhead_s"}, what a step costs in a serving worker beyond the same step alone
    (the other processes on the cores, the engine loop's own work)."""

    def step_s(self, num_prefill_tokens: int, num_decode_seqs: int, num_context_tokens: int, tp: int = 1) -> float:
        """Seconds of one step (StepTimeModel); 0 for an empty one. Only tp 1 was measured."""
        if tp != 1:
            raise ValueError(f"the CPU fit was measured on one engine without tensor parallelism, not tp={tp}")
        if num_prefill_tokens == 0 and num_decode_seqs == 0:
            return 0.0
        row = features(num_prefill_tokens, num_decode_seqs, num_context_tokens, self.large_step_tokens)
        alone = float(sum(self.coefficients[name] * x for name, x in zip(FEATURES, row)))
        serving = self.meta.get("serving")  # tandem simulate --calibrate: a served step's own costs
        return alone if serving is None else alone * serving["scale"] + serving["step_overhead_s"]

    @classmethod
    def fit(cls, samples: Sequence[StepSample], kv_bytes_per_token: int, large_step_tokens: int | None = None,
            **meta: Any) -> CpuStepModel:
        """Least squares on relative error, coefficients >= 0; ``meta`` is kept as given, with
        the fit's own error on ``samples`` added under "fit_error"."""
        if len(samples) < len(FEATURES):
            raise ValueError(f"a fit of {len(FEATURES)} terms needs at least as many steps, got {len(samples)}")
        a = np.array([features(s.num_prefill_tokens, s.num_decode_seqs, s.num_context_tokens, large_step_tokens)
                      for s in samples])
        b = np.array([s.seconds for s in samples])
        if np.any(b <= 0):
            raise ValueError("every step's time must be > 0")
        weights = 1.0 / b  # each row divided by its own time: the residuals are relative errors
        x = nonnegative_least_squares(a * weights[:, None], b * weights)
        model = cls(dict(zip(FEATURES, map(float, x))), int(kv_bytes_per_token), large_step_tokens, dict(meta))
        model.meta["fit_error"] = error_summary(relative_errors(model, samples))
        return model

    def to_json(self, path: str | os.PathLike | None = None) -> Path:
        """Write the fit (default: default_fit_path()) -> where it went."""
        out = Path(path) if path is not None else default_fit_path()
        out.parent.mkdir(parents=True, exist_ok=True)
        doc = {"kind": "cpu_step_fit", "features": list(FEATURES), "coefficients": self.coefficients,
               "kv_bytes_per_token": self.kv_bytes_per_token, "large_step_tokens": self.large_step_tokens,
               **self.meta}
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(doc, indent=2))
        tmp.replace(out)  # a reader never sees half a file
        return out

    @classmethod
    def from_json(cls, path: str | os.PathLike | None = None) -> CpuStepModel:
        """Read a fit written by to_json (default: default_fit_path())."""
        src = Path(path) if path is not None else default_fit_path()
        doc = json.loads(src.read_text())
        if doc.get("kind") != "cpu_step_fit" or doc.get("features") != list(FEATURES):
            raise ValueError(f"{src} is not a CPU step fit with terms {', '.join(FEATURES)}")
        own = ("kind", "features", "coefficients", "kv_bytes_per_token", "large_step_tokens")
        meta = {k: v for k, v in doc.items() if k not in own}
        return cls({name: float(doc["coefficients"][name]) for name in FEATURES}, int(doc["kv_bytes_per_token"]),
                   doc.get("large_step_tokens"), meta)


def fit_held_out(samples: Sequence[StepSample], kv_bytes_per_token: int, large_step_tokens: int | None = None,
                 held_out_every: int = 4, **meta: Any) -> CpuStepModel:
    """Fit on all but every ``held_out_every``-th sample and record the error on those left
    out (meta "held_out_error"); then refit on all of them for the coefficients kept."""
    if held_out_every < 2:
        raise ValueError("held_out_every must be >= 2")
    held = [s for i, s in enumerate(samples) if i % held_out_every == held_out_every - 1]
    train = [s for i, s in enumerate(samples) if i % held_out_every != held_out_every - 1]
    partial = CpuStepModel.fit(train, kv_bytes_per_token, large_step_tokens)
    model = CpuStepModel.fit(samples, kv_bytes_per_token, large_step_tokens, **meta)
    model.meta["held_out_error"] = error_summary(relative_errors(partial, held))
    model.meta["held_out_coefficients"] = partial.coefficients
    return model


def load_or_measure(path: str | os.PathLike | None = None, model: str | None = None, num_threads: int = 1,
                    **measure_kwargs: Any) -> CpuStepModel:
    """The fit kept at ``path`` when it holds for this machine, model, thread count and clock,
    else a new one measured now (measure_steps.measure_and_fit) and kept there."""
    from tandem.sim import measure_steps

    src = Path(path) if path is not None else default_fit_path()
    if src.is_file():
        try:
            fit = CpuStepModel.from_json(src)
        except (ValueError, KeyError, json.JSONDecodeError) as e:
            logger.warning("ignoring the step fit at %s: %s", src, e)
        else:
            wanted = {"machine": asdict(measure_steps.machine_description()), "model_arg": model,
                      "num_threads": num_threads,
                      "clock": measure_steps.resolve_clock(measure_kwargs.get("clock", "auto"), num_threads)}
            if all(fit.meta.get(k) == v for k, v in wanted.items()):
                return fit
            logger.info("the step fit at %s is for another machine, model, thread count or clock: measuring again",
                        src)
    fit = measure_steps.measure_and_fit(model, num_threads=num_threads, **measure_kwargs)
    fit.to_json(src)
    return fit
