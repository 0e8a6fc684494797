"""Timing real engine steps on this machine, for step_time.py's CPU fit.

The engine is the one a ``tandem serve`` worker runs by default: the default model (or
``model``), device cpu, the default dtype (float32 on the CPU) and weight format
(``quantization`` auto: the GGUF file's own int4 blocks), the default pool, token budget and
prefix caching, ``num_threads`` torch threads with the worker's per-step thread policy
(``tandem bench serve`` gives each of the two workers one of the two cores, hence 1).

Each step is timed whole (engine.step: schedule, forward, sampling, update), as decode_steps.py
times them for ``tandem bench engine``, and its composition is read off the batch the engine
runs (an EngineObserver): prompt tokens computed, decoding sequences, KV tokens attended over.
On one thread the clock is this process's CPU time, not the wall's: the fit is of a worker
with its core to itself, and on a shared machine (2 cores, neighbours' test runs taking 80%
of them) the wall clock counts the neighbours' time slices too, stretching steps 2-8x at
random. Several threads' CPU time adds up beyond the wall's, so there the wall clock is used.
Two grids:
  decode: at each context, 1 .. 32 sequences of one shared prompt (the prefix cache makes 32
  sequences of 1024 tokens cost one prefill to set up; attention still reads each
  sequence's blocks), a few pure decode steps at each batch size;
  prefill: a fresh prompt of 16 .. 512 tokens computed in one step, alone and beside 4 or
  16 decoding sequences, and long prompts whose later chunks attend over earlier ones.
Every step of both counts, the steps that admit new sequences included.
"""

from __future__ import annotations

import logging
import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from tandem.sim.step_time import CpuStepModel, StepSample, fit_held_out

if TYPE_CHECKING:
    from tandem.engine.engine import LLMEngine
    from tandem.engine.scheduler import ScheduledBatch
    from tandem.engine.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Machine:
    """What a CPU fit holds for."""

    cpu_model: str
    num_cores: int
    arch: str


def machine_description() -> Machine:
    """This machine's CPU (the model string from /proc/cpuinfo where there is one)."""
    name = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return Machine(name, os.cpu_count() or 1, platform.machine())


@dataclass(frozen=True)
class Grid:
    """The steps measure_steps times."""

    contexts: tuple[int, ...] = (64, 256, 1024)
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    decode_repeats: int = 3
    prefill_sizes: tuple[int, ...] = (16, 32, 64, 128, 256, 512)
    prefill_decode_batches: tuple[int, ...] = (0, 4, 16)
    prefill_decode_context: int = 256
    prefill_repeats: int = 2
    long_prompts: tuple[int, ...] = (1024,)


DEFAULT_GRID = Grid()
QUICK_GRID = Grid((64, 512), (1, 4, 16), 2, (32, 128, 384), (0, 8), 192, 1, ())
"""A smaller grid (tests): about a fifth of the default's time."""


class _Recorder:
    """An EngineObserver that keeps the composition of the batch about to run."""

    def __init__(self) -> None:
        self.last: tuple[int, int, int] | None = None

    def on_step(self, batch: ScheduledBatch) -> None:
        prefill = decode = context = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if seq.num_computed_tokens < seq.num_prompt_tokens:
                prefill += n
            else:
                decode += 1
            context += seq.num_computed_tokens + n  # its KV after the step: what it attends over
        self.last = (prefill, decode, context)

    def on_first_token(self, seq: Sequence) -> None:
        pass

    def on_finished(self, seq: Sequence) -> None:
        pass


class _Stepper:
    """Steps an engine, timing each step and keeping it as a StepSample."""

    def __init__(self, engine: LLMEngine, recorder: _Recorder, rng: np.random.Generator,
                 clock: Callable[[], float]) -> None:
        """recorder: ``engine``'s observer."""
        self.engine, self.recorder, self.rng, self.clock = engine, recorder, rng, clock
        self.samples: list[StepSample] = []
        self.vocab_size = engine.config.model.vocab_size

    def prompt(self, length: int) -> list[int]:
        """Uniform random ids: no two such prompts share a prefix block."""
        return [int(t) for t in self.rng.integers(0, self.vocab_size, size=length)]

    def add(self, request_id: str, prompt: list[int], max_tokens: int) -> None:
        from tandem.sampling_params import SamplingParams

        self.engine.add_request(request_id, prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                   ignore_eos=True))

    def step(self) -> None:
        self.recorder.last = None
        start = self.clock()
        self.engine.step()
        elapsed = self.clock() - start
        if self.recorder.last is not None:
            self.samples.append(StepSample(*self.recorder.last, elapsed))

    def prefilling(self) -> bool:
        return any(s.num_computed_tokens < s.num_prompt_tokens for s in self.engine.sequences.values())

    def step_until_decoding(self) -> None:
        while self.prefilling():
            self.step()

    def step_until_done(self, request_id: str) -> None:
        while request_id in self.engine.sequences:
            self.step()

    def abort_all(self) -> None:
        for request_id in list(self.engine.sequences):
            self.engine.abort_request(request_id)


def _decode_grid(s: _Stepper, grid: Grid, max_model_len: int) -> None:
    for context in grid.contexts:
        prompt = s.prompt(context)
        max_tokens = min(len(grid.batch_sizes) * (grid.decode_repeats + 4) + 8, max_model_len - context)
        running = 0
        for batch in grid.batch_sizes:
            for i in range(running, batch):
                s.add(f"decode-{context}-{i}", prompt, max_tokens)
            running = max(running, batch)
            s.step_until_decoding()
            for _ in range(grid.decode_repeats):
                s.step()
        s.abort_all()


def _prefill_grid(s: _Stepper, grid: Grid, max_model_len: int) -> None:
    for num_decode in grid.prefill_decode_batches:
        context = grid.prefill_decode_context
        prompt = s.prompt(context)
        for i in range(num_decode):
            s.add(f"beside-{num_decode}-{i}", prompt, max_model_len - context)
        s.step_until_decoding()
        for rep in range(grid.prefill_repeats):
            for size in grid.prefill_sizes:
                request_id = f"prefill-{num_decode}-{size}-{rep}"
                s.add(request_id, s.prompt(size), 1)  # one token: it leaves after its prefill
                s.step_until_done(request_id)
        for length in grid.long_prompts:
            s.add(f"long-{num_decode}-{length}", s.prompt(length), 1)
            s.step_until_done(f"long-{num_decode}-{length}")
        s.abort_all()


CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def resolve_clock(clock: str, num_threads: int) -> str:
    """auto -> cpu on one thread, wall on more (see the module's doc)."""
    if clock == "auto":
        return "cpu" if num_threads == 1 else "wall"
    if clock not in CLOCKS:
        raise ValueError(f"clock must be auto, {' or '.join(CLOCKS)}, got {clock!r}")
    return clock


def measure_steps(model: str | None = None, *, num_threads: int = 1, grid: Grid = DEFAULT_GRID,
                  seed: int = 0, clock: str = "auto") -> tuple[list[StepSample], dict]:
    """Time the grid's steps on the engine a serve worker runs (see the module's doc) ->
    (the steps, what they hold for: machine, model, dtype, quantization, threads, ...).
    clock: "cpu" (this process's CPU time), "wall", or auto: cpu on one thread, else wall."""
    clock = resolve_clock(clock, num_threads)
    import torch

    from tandem.bench.serving.interference import CpuWatch
    from tandem.engine.step_threads import StepThreads
    from tandem.llm import LLM

    threads_before = torch.get_num_threads()
    started = time.perf_counter()
    try:
        recorder = _Recorder()
        llm = LLM(model, device="cpu", num_threads=num_threads, observer=recorder,
                  step_threads=StepThreads.for_served_worker(num_threads))  # as worker.base's on the CPU
        engine = llm.engine
        stepper = _Stepper(engine, recorder, np.random.default_rng(seed), CLOCKS[clock])
        max_model_len = engine.config.max_model_len
        # First-call costs (allocations, kernel builds) stay out: a short and a long prompt, a decode.
        stepper.add("warm-short", stepper.prompt(32), 4)
        stepper.add("warm-long", stepper.prompt(max(grid.prefill_sizes, default=64)), 2)
        while engine.has_unfinished:
            engine.step()
        watch = CpuWatch([])
        watch.start()
        _decode_grid(stepper, grid, max_model_len)
        _prefill_grid(stepper, grid, max_model_len)
        others_cpu = watch.stop()
        config = engine.config
        meta = {
            "machine": asdict(machine_description()), "model_arg": model, "model": config.model.name,
            "device": config.device_name, "dtype": config.dtype_name, "quantization": config.quantization,
            "num_threads": num_threads, "clock": clock, "torch_version": torch.__version__,
            "max_num_batched_tokens": config.max_num_batched_tokens, "block_size": config.block_size,
            "kv_bytes_per_token": config.model.kv_bytes_per_token(config.kv_cache_dtype_name),
            "others_cpu": others_cpu, "measure_s": time.perf_counter() - started, "grid": asdict(grid),
            "seed": seed,
        }
        llm.shutdown()
    finally:
        torch.set_num_threads(threads_before)
    if others_cpu >= 0.1:
        logger.warning("other processes took %.0f%% of the CPU while the steps were timed: the fit may be off",
                       100 * others_cpu)
    logger.info("timed %d engine steps in %.1f s", len(stepper.samples), meta["measure_s"])
    return stepper.samples, meta


def large_step_tokens(quantization: str | None) -> int | None:
    """Rows above which the CPU's quantized products change their way (step_time.py's L):
    int4 leaves its GEMV kernel for a dequantized bf16 GEMM, int8 its kernel for dequantizing;
    float weights have one way."""
    if quantization == "int4":
        from tandem.model.int4_matmul import GEMV_MAX_TOKENS

        return GEMV_MAX_TOKENS
    if quantization == "int8":
        from tandem.model.quantization import KERNEL_MAX_TOKENS

        return KERNEL_MAX_TOKENS
    return None


def measure_and_fit(model: str | None = None, *, num_threads: int = 1, grid: Grid = DEFAULT_GRID, seed: int = 0,
                    held_out_every: int = 4, clock: str = "auto") -> CpuStepModel:
    """measure_steps, then step_time.fit_held_out: the fit with its held-out error in meta;
    the steps themselves are kept in meta "samples" (to refit without measuring)."""
    samples, meta = measure_steps(model, num_threads=num_threads, grid=grid, seed=seed, clock=clock)
    kv_bytes = meta.pop("kv_bytes_per_token")
    fit = fit_held_out(samples, kv_bytes, large_step_tokens(meta["quantization"]), held_out_every, **meta)
    fit.meta["samples"] = [asdict(s) for s in samples]
    return fit
