"""The names engine flags are checked against, in one torch-free table beside config.py, so
that config.py imports nothing above it (not the model layer, not the engine, not torch).

Everything here is a plain fact about a name: ``tandem plan``, ``tandem serve`` (the router)
and the KV transfer headers use these without loading torch; the torch side maps a dtype's
name to its torch dtype in one place, tandem/model/dtypes.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

DTYPE_BYTES: Mapping[str, int] = MappingProxyType({"float32": 4, "bfloat16": 2, "float16": 2})
"""The engine's dtypes by name, with their bytes per element: the one table of them. Each
name is also torch's (``torch.float32``, ...), which is how tandem/model/dtypes.py maps it."""

DTYPE_NAMES: tuple[str, ...] = tuple(DTYPE_BYTES)
"""The names of DTYPE_BYTES, in the order flags and messages list them."""

PREEMPTION_MODES = ("auto", "swap", "recompute")
"""auto: swap sequences of at least SWAP_MIN_BLOCKS blocks (tandem/engine/preemption.py);
swap: always; recompute: never. Swapping also needs room in the host pool, else the sequence
is recomputed."""

QUANTIZATION_METHODS = ("int8", "int4")
"""Weight-only quantization done at start (tandem/model/quantization.py): int8 with a scale
per output channel, or int4 in groups of 32 input channels (GGUF Q4_1's form)."""
