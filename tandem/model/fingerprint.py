"""A model's identity for KV transfer handshakes: KV computed by one set of weights is
garbage to another, even when the shapes agree."""

from __future__ import annotations

import hashlib

import torch

from tandem.model.loader import LoadedModel
from tandem.model.quantization import Int8Weight

SAMPLE_ELEMENTS = 4096


def model_fingerprint(loaded: LoadedModel) -> str:
    """-> "name:hash" over the config and samples of the weights that shape every layer's
    KV (embeddings, each layer's QKV projection, the final norm); cheap at start-up."""
    digest = hashlib.blake2b(repr(loaded.config).encode(), digest_size=8)
    w = loaded.weights
    for weight in (w.embed_tokens, *(layer.qkv_proj for layer in w.layers), w.norm):
        # A quantized weight is its values and scales: workers on different quantizations differ.
        for tensor in (weight.qweight, weight.scale) if isinstance(weight, Int8Weight) else (weight,):
            sample = tensor.detach().flatten()[:SAMPLE_ELEMENTS].to(torch.float32).contiguous()
            digest.update(sample.numpy().tobytes())
    return f"{loaded.config.name}:{digest.hexdigest()}"
