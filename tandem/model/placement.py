"""Moving a model's weights onto the engine's device, once, after loading and quantizing
(both run on the host: transformers loads there and the GGUF/int4 code reads files there)."""

from __future__ import annotations

import dataclasses
from typing import TypeVar, overload

import torch

from tandem.model.int4 import Int4Weight
from tandem.model.llama import ModelWeights
from tandem.model.quantization import Int8Weight, Weight, weight_key

W = TypeVar("W", bound=Weight)


def weights_on(weights: ModelWeights, device: torch.device) -> ModelWeights:
    """``weights`` with every tensor on ``device``: the same object where they are there
    already (a CPU engine shares its weights with whoever loaded them), else a copy in
    which tied weights stay one tensor (the LM head and the embeddings)."""
    if same_device(weights.embed_tokens.device, device):
        return weights
    moved: dict[int, Weight] = {}

    @overload
    def on(w: None) -> None: ...

    @overload
    def on(w: W) -> W: ...

    def on(w: W | None) -> W | None:
        if w is None:
            return None
        key = weight_key(w)
        if key not in moved:
            moved[key] = _weight_on(w, device)
        return moved[key]  # type: ignore[return-value]  # w's copy: the same kind of weight as w

    layers = [dataclasses.replace(layer, **{f.name: on(getattr(layer, f.name)) for f in dataclasses.fields(layer)})
              for layer in weights.layers]
    return dataclasses.replace(weights, embed_tokens=on(weights.embed_tokens), layers=layers, norm=on(weights.norm),
                               lm_head=on(weights.lm_head), rope_inv_freq=on(weights.rope_inv_freq))


def same_device(a: torch.device, b: torch.device) -> bool:
    """Whether ``a`` and ``b`` name one device: ``cuda`` is the current CUDA device (as
    torch places a tensor asked for ``cuda``), which a tensor's device names as ``cuda:N``."""
    return _indexed(a) == _indexed(b)


def _indexed(device: torch.device) -> torch.device:
    if device.type != "cuda" or device.index is not None:
        return device
    # NOTE: without a CUDA runtime (fake CUDA tensors) the only device is cuda:0.
    return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)


def _weight_on(w: Weight, device: torch.device) -> Weight:
    if isinstance(w, Int8Weight):
        return Int8Weight(w.qweight.to(device), w.scale.to(device))
    if isinstance(w, Int4Weight):  # a new instance: no CPU kernel pack comes along
        return Int4Weight(w.qweight.to(device), w.scale.to(device), w.offset.to(device), w.group_size)
    return w.to(device)
