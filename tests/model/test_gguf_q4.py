"""GGUF Q4_1 kept as int4: the block layout against gguf's own dequantizer, the q/k row
permutation against transformers' reverse permute, and on the default model every kept
projection bit-exact to the float32 weights transformers loads from the same file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from tandem.model.gguf_q4 import Q4File, gguf_path, int4_from_q4_1_blocks, keep_gguf_int4, unpermute_rows
from tandem.model.int4 import Int4Weight
from tandem.model.loader import quantized
from tandem.model.quantization import Int8Weight, quantize_int8, quantize_weights
from tandem.model.source import resolve_model_source

Q4_1 = GGMLQuantizationType.Q4_1


def random_q4_1_bytes(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Raw Q4_1 tensor bytes [rows, cols // 32 * 20]: random nibbles, finite float16 d and m."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, cols // 32, 20), dtype=np.uint8)
    raw[..., 0:2] = rng.uniform(1e-4, 1e-1, size=(rows, cols // 32, 1)).astype(np.float16).view(np.uint8)
    raw[..., 2:4] = rng.uniform(-1, 1, size=(rows, cols // 32, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("source", ["random bytes", "gguf.quants.quantize"])
def test_blocks_dequantize_exactly_as_gguf(source):
    rows, cols = 24, 96
    if source == "random bytes":
        raw = random_q4_1_bytes(rows, cols)
    else:
        floats = np.random.default_rng(1).standard_normal((rows, cols)).astype(np.float32)
        raw = gguf_quantize(floats, Q4_1)
    w = int4_from_q4_1_blocks(raw, rows, cols)
    assert isinstance(w, Int4Weight) and w.group_size == 32 and w.shape == (rows, cols)
    expected = torch.from_numpy(gguf_dequantize(raw, Q4_1).reshape(rows, cols).copy())
    assert torch.equal(w.dequantize(), expected)  # bit-exact: same values, same float32 arithmetic
    # d and m are the stored float16s themselves.
    blocks = raw.reshape(rows, cols // 32, 20)
    assert np.array_equal(w.scale.numpy(), blocks[..., 0:2].copy().view(np.float16)[..., 0])
    assert np.array_equal(w.offset.numpy(), blocks[..., 2:4].copy().view(np.float16)[..., 0])


@pytest.mark.parametrize("num_heads", [1, 3, 9])
def test_row_permutation_matches_transformers(num_heads):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rows, cols = num_heads * 16, 64
    raw = random_q4_1_bytes(rows, cols, seed=num_heads)
    file_order = gguf_dequantize(raw, Q4_1).reshape(rows, cols)
    expected = LlamaTensorProcessor()._reverse_permute_weights(file_order, num_heads, num_heads)
    w = unpermute_rows(int4_from_q4_1_blocks(raw, rows, cols), num_heads)
    assert torch.equal(w.dequantize(), torch.from_numpy(np.ascontiguousarray(expected)))


@pytest.fixture(scope="module")
def default_source():
    return resolve_model_source(None)


@pytest.fixture(scope="module")
def kept(loaded, default_source):
    """The default model's weights with the file's Q4_1 blocks kept (read once)."""
    path = gguf_path(default_source)
    assert path is not None
    return keep_gguf_int4(loaded.weights, loaded.config, path)


@pytest.mark.slow
def test_default_file_is_q4_1_but_its_embedding(default_source):
    path = gguf_path(default_source)
    assert path is not None
    types = Q4File(path).types
    projections = [n for n in types if n.startswith("blk.") and ("attn_" in n or "ffn_" in n) and "norm" not in n]
    assert len(projections) == 30 * 7 and {types[n] for n in projections} == {"Q4_1"}
    assert types["token_embd.weight"] == "Q8_0"  # the tied LM head: quantized from its float copy


@pytest.mark.slow
def test_kept_projections_are_bit_exact_to_transformers(kept, hf_model, loaded):
    """Each Int4Weight built from the file dequantizes to exactly the float32 tensor that
    transformers computes from the same file (gguf.quants' dequantization, then its reverse
    permute of q and k): the independent reference."""
    state = hf_model.state_dict()
    cfg = loaded.config
    q_size, kv_size, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    for i, layer in enumerate(kept.layers):
        p = f"model.layers.{i}."
        parts = {
            "self_attn.q_proj": layer.qkv_proj.rows(0, q_size),
            "self_attn.k_proj": layer.qkv_proj.rows(q_size, q_size + kv_size),
            "self_attn.v_proj": layer.qkv_proj.rows(q_size + kv_size, q_size + 2 * kv_size),
            "self_attn.o_proj": layer.o_proj,
            "mlp.gate_proj": layer.gate_up_proj.rows(0, inter),
            "mlp.up_proj": layer.gate_up_proj.rows(inter, 2 * inter),
            "mlp.down_proj": layer.down_proj,
        }
        for name, w in parts.items():
            assert isinstance(w, Int4Weight) and w.group_size == 32
            assert torch.equal(w.dequantize(), state[p + name + ".weight"]), f"layer {i} {name}"
    # Not Q4_1 in the file (Q8_0): the LM head is int8 of its float copy, as quantize_weights
    # makes it for int4; the embedding table itself stays the loaded float tensor.
    head = quantize_int8(state["lm_head.weight"])
    assert isinstance(kept.lm_head, Int8Weight)
    assert torch.equal(kept.lm_head.qweight, head.qweight) and torch.equal(kept.lm_head.scale, head.scale)
    assert kept.embed_tokens is loaded.weights.embed_tokens


@pytest.mark.slow
def test_quantized_keeps_the_file_blocks_and_requantizing_gives_them_back(kept, loaded, default_source):
    """quantized(..., "int4", source) is keep_gguf_int4; and quantize_int4 of the float32
    copy finds every group's blocks again (llama.cpp's Q4_1 is the same min/max rule), so
    for this file both ways give identical int4 weights."""
    via_loader = quantized(loaded, "int4", default_source).weights
    again = quantize_weights(loaded.weights, "int4")
    for a, b, c in zip(kept.layers, via_loader.layers, again.layers):
        for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            x, y, z = getattr(a, name), getattr(b, name), getattr(c, name)
            for f in ("qweight", "scale", "offset"):
                assert torch.equal(getattr(x, f), getattr(y, f)) and torch.equal(getattr(x, f), getattr(z, f)), name
