"""The KV handshake's model identity: equal for equal weights, different for each quantization."""

from __future__ import annotations

from tandem.model.fingerprint import model_fingerprint
from tandem.model.loader import LoadedModel, quantized


def test_each_quantization_has_its_own_fingerprint(loaded):
    same = LoadedModel(loaded.config, loaded.weights, loaded.tokenizer)
    prints = [model_fingerprint(m) for m in (loaded, quantized(loaded, "int8"), quantized(loaded, "int4"))]
    assert model_fingerprint(same) == prints[0]
    assert len(set(prints)) == 3
    assert all(p.startswith(f"{loaded.config.name}:") for p in prints)
