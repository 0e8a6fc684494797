"""How to preempt a sequence: swap its KV out to host memory, or drop it and recompute.

Policy only: the scheduler asks, and checks the host pool's room itself.
"""

from __future__ import annotations

SWAP_MIN_BLOCKS = 1
"""In ``auto`` mode, sequences holding at least this many computed blocks are swapped.

Measured with ``tandem bench swap --num-threads 1`` (SmolLM2-135M, float32, block size 16,
one CPU thread, a busy 2-core machine): swapping N blocks out and back in took 0.18, 1.81,
18.5 and 58.2 ms for N = 1, 4, 16, 64, while recomputing their tokens added 61, 233, 856
and 3491 ms to a step of 8 decodes (context 256; the step alone: 99 ms). Swapping is
cheaper from one block on (40x to 450x; a second run: 33x to 368x), so the policy swaps
whenever the host pool has room. Re-measure on a GPU (PCIe copies against a fast prefill) before raising it.
"""


def should_swap(preemption_mode: str, num_blocks: int) -> bool:
    """Whether a sequence whose computed KV fills ``num_blocks`` blocks should be swapped
    (if the host pool has room) rather than recomputed. ``preemption_mode``: see EngineConfig."""
    if num_blocks == 0 or preemption_mode == "recompute":
        return False
    return preemption_mode == "swap" or num_blocks >= SWAP_MIN_BLOCKS
