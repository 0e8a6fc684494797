"""The engine's dtypes on the torch side: the one mapping between a dtype's name and torch.

The names and their sizes are torch-free facts (tandem.config.names.DTYPE_BYTES); each name is
also torch's attribute name, so the mapping is derived from that table rather than kept as a
second one.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

import torch

from tandem.config.names import DTYPE_BYTES

DTYPES: Mapping[str, torch.dtype] = MappingProxyType({name: getattr(torch, name) for name in DTYPE_BYTES})
"""torch dtype by name, for each of DTYPE_BYTES (read-only)."""
_NAMES: Mapping[torch.dtype, str] = MappingProxyType({dtype: name for name, dtype in DTYPES.items()})


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name``; ValueError for a name the engine does not take."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def dtype_name(dtype: torch.dtype) -> str:
    """The name of an engine dtype (``torch.float16`` -> "float16"); ValueError for another."""
    if dtype not in _NAMES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype}")
    return _NAMES[dtype]
