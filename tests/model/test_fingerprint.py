"""The KV handshake's model identity: equal for equal weights, different for each quantization
and for any changed byte."""

from __future__ import annotations

import dataclasses

import torch

from tandem.model.fingerprint import model_fingerprint
from tandem.model.loader import LoadedModel, quantized


def test_each_quantization_has_its_own_fingerprint(loaded):
    same = LoadedModel(loaded.config, loaded.weights, loaded.tokenizer)
    prints = [model_fingerprint(m) for m in (loaded, quantized(loaded, "int8"), quantized(loaded, "int4"))]
    assert model_fingerprint(same) == prints[0]
    assert len(set(prints)) == 3
    assert all(p.startswith(f"{loaded.config.name}:") for p in prints)


def test_one_byte_anywhere_changes_it(loaded):
    """Not a sample: the last element of the last layer's down projection counts too."""
    layers = list(loaded.weights.layers)
    down = layers[-1].down_proj.clone()
    down.view(-1)[-1] = torch.nextafter(down.view(-1)[-1], torch.tensor(float("inf")))
    layers[-1] = dataclasses.replace(layers[-1], down_proj=down)
    changed = LoadedModel(loaded.config, dataclasses.replace(loaded.weights, layers=layers), loaded.tokenizer)
    assert model_fingerprint(changed) != model_fingerprint(loaded)
