"""A model's identity for KV transfer handshakes: KV computed by one set of weights is
garbage to another, even when the shapes agree."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Iterator

import torch

from tandem.model.loader import LoadedModel


def model_fingerprint(loaded: LoadedModel) -> str:
    """-> "name:hash" over the config and every byte of every weight (a quantized weight's
    values, scales and offsets too: workers on different quantizations differ). Computed once
    at load: about a second a GB."""
    digest = hashlib.blake2b(repr(loaded.config).encode(), digest_size=16)
    seen: set[tuple[int, int]] = set()  # a tied lm_head is the embedding's very tensor
    for name, value in _leaves(loaded.weights, "weights"):
        digest.update(name.encode())
        if isinstance(value, torch.Tensor):
            key = (value.data_ptr(), value.numel())
            if key not in seen:
                seen.add(key)
                raw = value.detach().to("cpu").contiguous().flatten().view(torch.uint8)
                digest.update(repr((value.dtype, tuple(value.shape))).encode())
                digest.update(raw.numpy().data)
        else:
            digest.update(repr(value).encode())
    return f"{loaded.config.name}:{digest.hexdigest()}"


def _leaves(value: Any, name: str) -> Iterator[tuple[str, Any]]:
    """(path, tensor or scalar) for every leaf of nested dataclasses and lists, in order."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _leaves(getattr(value, f.name), f"{name}.{f.name}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _leaves(item, f"{name}[{i}]")
    else:
        yield name, value
