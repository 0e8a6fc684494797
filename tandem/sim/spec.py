"""What a simulation is given: the requests, the cluster's shape, and how long a step takes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class SimRequest:
    """One request of a simulated workload."""

    arrival_s: float
    """When it arrives, from the start of the run."""
    prompt_token_ids: tuple[int, ...]
    """Real token ids, so that the block manager's prefix cache hashes them as it would."""
    output_len: int
    """Tokens it generates (greedy with EOS ignored, as the bench sends)."""
    kind: str = "trace"
    """The bench's "short" or "long", or "trace"."""


class StepTimeModel(Protocol):
    """How long one engine step takes on one worker."""

    def step_s(self, num_prefill_tokens: int, num_decode_seqs: int, num_context_tokens: int, tp: int = 1) -> float:
        """Seconds for a step that computes ``num_prefill_tokens`` prompt tokens and one token
        of each of ``num_decode_seqs`` running sequences, attending over
        ``num_context_tokens`` KV tokens in all, on a worker of ``tp`` tensor-parallel ranks."""
        ...

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV one token holds over all layers (what a transfer moves)."""
        ...


@dataclass(frozen=True)
class PoolSpec:
    """One pool of identical workers."""

    num_workers: int
    tp: int = 1
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    """The step's token budget (a prompt longer is chunked)."""
    num_kv_blocks: int = 4096
    block_size: int = 16


@dataclass(frozen=True)
class ClusterSpec:
    """A simulated cluster: colocated workers, or a prefill and a decode pool."""

    mode: str
    """"colocated" or "disaggregated"."""
    colocated: PoolSpec | None = None
    prefill: PoolSpec | None = None
    decode: PoolSpec | None = None
    disagg_policy: str = "always"
    """router.disagg's policy name (disaggregated only)."""
    max_local_stall_s: float = 0.1
    routing_policy: str = "least_loaded"
    link_bytes_per_s: float = 10e9
    """Prefill -> decode KV bandwidth."""
    link_latency_s: float = 1e-4
    router_overhead_s: float = 0.0
    """Added to each request's way in (tokenizing, the router hop), fitted for the CPU."""
