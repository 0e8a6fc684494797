"""The names engine flags are checked against, in one torch-free table beside config.py, so
that config.py imports nothing above it (not the model layer, not the engine)."""

from __future__ import annotations

PREEMPTION_MODES = ("auto", "swap", "recompute")
"""auto: swap sequences of at least SWAP_MIN_BLOCKS blocks (tandem/engine/preemption.py);
swap: always; recompute: never. Swapping also needs room in the host pool, else the sequence
is recomputed."""
