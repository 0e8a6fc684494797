"""The engine's dtypes: one table of names and sizes (config.names), one mapping to torch (model.dtypes)."""

from __future__ import annotations

import pytest
import torch

from tandem.config.names import DTYPE_BYTES, DTYPE_NAMES
from tandem.kvtransfer.payload import TORCH_DTYPES
from tandem.kvtransfer.protocol import DTYPES as WIRE_DTYPES
from tandem.model.dtypes import DTYPES, dtype_name, torch_dtype


@pytest.mark.parametrize("name", DTYPE_NAMES)
def test_each_name_maps_to_torch_and_back(name: str) -> None:
    assert torch_dtype(name) is DTYPES[name] is TORCH_DTYPES[name]
    assert dtype_name(torch_dtype(name)) == name
    assert torch_dtype(name).itemsize == DTYPE_BYTES[name]


def test_every_table_is_the_one_table() -> None:
    assert tuple(DTYPES) == tuple(TORCH_DTYPES) == WIRE_DTYPES == DTYPE_NAMES == tuple(DTYPE_BYTES)


def test_other_dtypes_are_refused() -> None:
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, float16, got 'int3'"):
        torch_dtype("int3")
    with pytest.raises(ValueError, match="got torch.int8"):
        dtype_name(torch.int8)
