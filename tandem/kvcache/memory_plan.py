"""Sizing a GPU worker's KV pool from a fraction of the device's memory (vLLM's
``gpu_memory_utilization``), torch-free: the worker fills it with measured figures and logs
it; ``tandem plan`` fills it from the model's shapes and prints the same lines.

    budget    = utilization × device memory
    KV memory = budget − weights − peak of one full-budget step − the decode graphs' pool
    KV blocks = KV memory // bytes per block
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.config import ModelConfig


@dataclass(frozen=True)
class DeviceMemoryPlan:
    """One worker's (or rank's) share of a device's memory."""

    device_bytes: int
    """The device's whole memory."""
    utilization: float
    """The fraction of device_bytes this worker may use, in (0, 1]."""
    weight_bytes: int
    step_peak_bytes: int
    """Memory one step of the full token budget takes beyond the weights (activations, logits)."""
    block_bytes: int
    measured: bool
    """Whether weight_bytes and step_peak_bytes were measured on the device (a worker) or
    estimated from the shapes (``tandem plan``)."""
    graph_bytes: int = 0
    """Memory the captured decode graphs hold (their pool and output), always estimated from the
    shapes: they are captured after the KV pool is allocated (0: no graphs, enforce_eager)."""

    def __post_init__(self) -> None:
        if not 0 < self.utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.utilization!r}")

    @property
    def budget_bytes(self) -> int:
        return int(self.device_bytes * self.utilization)

    @property
    def kv_bytes(self) -> int:
        return self.budget_bytes - self.weight_bytes - self.step_peak_bytes - self.graph_bytes

    @property
    def num_blocks(self) -> int:
        """KV blocks that fit; ValueError when not one does."""
        if self.kv_bytes < self.block_bytes:
            raise ValueError(
                f"gpu_memory_utilization {self.utilization} of {_gib(self.device_bytes)} leaves no room for a KV "
                f"block: weights {_gib(self.weight_bytes)} and a step's peak {_gib(self.step_peak_bytes)} take "
                f"{_gib(self.weight_bytes + self.step_peak_bytes)} of {_gib(self.budget_bytes)}; raise it, or a "
                "smaller --max-num-batched-tokens or --dtype")
        return self.kv_bytes // self.block_bytes

    def lines(self) -> list[str]:
        """The plan as the worker logs it and ``tandem plan`` prints it."""
        how = "measured" if self.measured else "estimated from the shapes"
        graphs = [f"decode CUDA graphs: {_gib(self.graph_bytes)} (estimated from the shapes; measured at capture)"]
        return [
            f"device memory: {_gib(self.device_bytes)} x gpu_memory_utilization {self.utilization} "
            f"= {_gib(self.budget_bytes)}",
            f"weights: {_gib(self.weight_bytes)}, one full-budget step's peak: {_gib(self.step_peak_bytes)} ({how})",
            *(graphs if self.graph_bytes else []),
            f"KV pool: {_gib(self.kv_bytes)} = budget - weights - step peak{' - graphs' if self.graph_bytes else ''}: "
            f"{self.num_blocks} blocks of {self.block_bytes} bytes",
        ]


def estimated_step_peak_bytes(shape: ModelConfig, num_tokens: int, num_seqs: int, dtype_bytes: int,
                              tp: int = 1) -> int:
    """An upper estimate of one step's activations over ``num_tokens`` tokens (one layer's
    live tensors at once: the residual, the norm's float32 copy, q/k/v, attention's output,
    gate/up and their product) plus float32 logits (and their softmax) for ``num_seqs`` rows."""
    q = shape.num_heads * shape.head_dim // tp
    kv = 2 * max(1, shape.num_kv_heads // tp) * shape.head_dim
    per_token = (2 * shape.hidden_size + q + kv + q + 3 * shape.intermediate_size // tp) * dtype_bytes
    per_token += shape.hidden_size * 4
    return num_tokens * per_token + min(num_seqs, num_tokens) * shape.vocab_size * 4 * 2


GRAPH_OVERHEAD_BYTES = 4 * 2**20
"""Device memory one captured graph holds beyond its tensors (its instantiated kernel nodes'
parameters): an allowance, a few MiB, as CUDA's graphs of a few hundred nodes take."""


def estimated_graph_pool_bytes(shape: ModelConfig, batch_sizes: list[int], table_width: int,
                               dtype_bytes: int) -> int:
    """An upper estimate of what the captured decode steps of ``batch_sizes`` hold. They share
    one pool, the largest captured first, so the pool is about one step's peak at the largest
    batch (its activations and logits); plus the shared [largest, vocab] float32 output, each
    bucket's static inputs (its block table ``table_width`` wide and five vectors, int64), and
    GRAPH_OVERHEAD_BYTES a graph."""
    if not batch_sizes:
        return 0
    largest = max(batch_sizes)
    peak = estimated_step_peak_bytes(shape, largest, largest, dtype_bytes)
    output = largest * shape.vocab_size * 4
    inputs = sum(batch_sizes) * (table_width + 6) * 8
    return peak + output + inputs + len(batch_sizes) * GRAPH_OVERHEAD_BYTES


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.2f} GiB"
