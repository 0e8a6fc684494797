"""A model's identity for KV transfer handshakes: KV computed by one set of weights is
garbage to another, even when the shapes agree."""

from __future__ import annotations

import dataclasses
import hashlib

import torch

from tandem.model.loader import LoadedModel


SAMPLE_ELEMENTS = 4096


def model_fingerprint(loaded: LoadedModel) -> str:
    """-> "name:hash" over the config and samples of the weights that shape every layer's
    KV (embeddings, each layer's QKV projection, the final norm); cheap at start-up."""
    digest = hashlib.blake2b(repr(loaded.config).encode(), digest_size=8)
    w = loaded.weights
    for weight in (w.embed_tokens, *(layer.qkv_proj for layer in w.layers), w.norm):
        # A quantized weight is its values and scales (and offsets): workers on different quantizations differ.
        fields = [weight] if isinstance(weight, torch.Tensor) else [getattr(weight, f.name)
                                                                    for f in dataclasses.fields(weight)]
        for tensor in (t for t in fields if isinstance(t, torch.Tensor)):
            sample = tensor.detach().flatten()[:SAMPLE_ELEMENTS].to("cpu", torch.float32).contiguous()
            digest.update(sample.numpy().tobytes())
    return f"{loaded.config.name}:{digest.hexdigest()}"
