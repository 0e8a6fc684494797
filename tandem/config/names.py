"""The names engine flags are checked against, in one torch-free table beside model_config.py, so
that the configs import nothing above it (not the model layer, not the engine, not torch).

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

QUANTIZATION_CHOICES: tuple[str, ...] = ("auto", "none", *QUANTIZATION_METHODS)
"""What ``--quantization`` takes. auto: the model's own format (a GGUF file's Q4_1 projections
kept as int4, Q8_0 ones as int8; a float checkpoint stays float; see
tandem/model/gguf_format.py); none: float weights (a GGUF file dequantized)."""

AUTO = "auto"
"""The ``device`` and ``dtype`` choice that the engine's device decides (see below)."""

DTYPE_CHOICES: tuple[str, ...] = (AUTO, *DTYPE_NAMES)
"""What ``--dtype`` takes: ``auto`` or one of DTYPE_NAMES."""

KV_CACHE_DTYPE_CHOICES: tuple[str, ...] = (AUTO, *DTYPE_NAMES)
"""What ``--kv-cache-dtype`` takes (vLLM's flag): ``auto`` (see auto_kv_cache_dtype_name) or one
of DTYPE_NAMES, which may differ from the activations' dtype (the KV is cast as it is stored)."""


ACTIVATION_QUANTIZATIONS: tuple[str, ...] = ("none", "int8")
"""What ``--activation-quantization`` takes: whether the CPU's int4 and int8 weight products
keep their float32 activations (none) or round them to 8 bits (int8, on CPUs with AVX-512 VNNI;
kernels/int4_gemv_cpu.py).

NOTE: not int8 by default. The rounding is a step function, so float differences too small to
move a greedy token elsewhere (the prefill and decode attention kernels' orders, a context
split by batch size) can move an activation to the next step of 1/127 of its group's maximum:
with it the compatibility matrix found a request's tokens differing between a disaggregated
and a colocated run (9 of its cases), where float32 activations keep them equal."""


def check_device_name(name: str) -> str:
    """``name`` if it is a device the engine takes: ``auto``, ``cpu``, ``cuda`` or ``cuda:N``;
    ValueError otherwise."""
    kind, _, index = name.partition(":")
    if name in (AUTO, "cpu", "cuda") or (kind == "cuda" and index.isdigit()):
        return name
    raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {name!r}")


def auto_dtype_name(device: str, bfloat16_supported: bool = True) -> str:
    """``dtype auto``'s choice on ``device`` (a resolved name: cpu, cuda, cuda:N): bfloat16 on
    CUDA (float16 where the GPU lacks bfloat16), float32 on the CPU, where float32 is what
    keeps the engine token-exact with transformers and runs fastest on the default model."""
    if device == "cpu":
        return "float32"
    return "bfloat16" if bfloat16_supported else "float16"


def auto_kv_cache_dtype_name(dtype: str, quantization: str | None, device: str = "cpu") -> str:
    """``kv_cache_dtype auto``'s choice for an engine on ``device`` (resolved) whose activations
    are ``dtype`` (resolved) and whose weights are ``quantization`` (resolved: None, int8, int4):
    the activations' dtype, always.

    NOTE: not bfloat16 for the quantized formats, although their compiled CPU step reads it
    10-14% faster at batch 8 and 32: with a bfloat16 cache a request's greedy tokens came to
    depend on what shared its steps (the compatibility matrix's preemption batch: one token
    in 56 differed once preemption changed the batches, in-process as on a cluster), where the
    float32 cache keeps every request's tokens its own. ``--kv-cache-dtype bfloat16`` asks for it."""
    del quantization, device  # (the choice may depend on them again once bfloat16 is batch-invariant)
    return dtype


def resolve_kv_cache_dtype(name: str, dtype: str, quantization: str | None, device: str = "cpu") -> str:
    """``auto`` -> auto_kv_cache_dtype_name; another name is checked and kept."""
    if name == AUTO:
        return auto_kv_cache_dtype_name(dtype, quantization, device)
    if name not in DTYPE_BYTES:
        raise ValueError(f"kv_cache_dtype must be auto or one of {', '.join(DTYPE_BYTES)}, got {name!r}")
    return name


def require(ok: bool, name: str, value: object, rule: str) -> None:
    """ValueError naming the option, its rule and the value given, unless `ok`."""
    if not ok:
        raise ValueError(f"{name} must be {rule}, got {value!r}")
