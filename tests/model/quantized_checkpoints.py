"""Write a float model as a real GPTQ or AWQ checkpoint directory (no such checkpoint can be
downloaded here), in the on-disk formats of AutoGPTQ/GPTQModel and AutoAWQ (gemm).

Each of q/k/v, o, gate/up and down is quantized by round-to-nearest, asymmetric min/max int4
per group of G input channels: ``scale = (max - min) / 15`` (rounded to float16 first, the
value stored), ``zero = clamp(round(-min / scale), 0, 15)``, ``q = clamp(round(w / scale) +
zero, 0, 15)``. GPTQ's Hessian-based error feedback changes which q are chosen, not how they
are stored, so it is left out: the files are what those tools write, byte layout and config
alike. As GPTQ's own quantizer does, the GPTQ range always includes 0 (min <= 0 <= max).

Everything else is stored as those tools store it: float parts in float16, config.json with a
``quantization_config``, generation_config.json and the tokenizer files; optionally sharded
with a model.safetensors.index.json.

The reader at the end unpacks a checkpoint with plain numpy bit operations, from the same
packing rules and independently of tandem/model/gptq_awq.py: the tests' reference.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import safetensors.torch
import torch

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: nibble k holds output channel AWQ_PACK_ORDER[k] of each 8


@dataclass
class GroupQuantized:
    """Round-to-nearest int4 of a weight [out, in] in groups of G input channels."""

    q: np.ndarray  # [out, in] uint32 in 0..15
    zeros: np.ndarray  # [out, in // G] uint32 in 0..15
    scales: np.ndarray  # [out, in // G] float16


def quantize_rtn(w: torch.Tensor, group_size: int, range_includes_zero: bool) -> GroupQuantized:
    """Asymmetric min/max int4 per group (see the module docstring); the last group is
    shorter when G does not divide the input size (GPTQ allows it)."""
    w = w.detach().float()
    qs, zeros, scales = [], [], []
    for start in range(0, w.shape[1], group_size):
        group = w[:, start:start + group_size]  # [out, G]
        low, high = group.amin(-1), group.amax(-1)
        if range_includes_zero:
            low, high = low.clamp(max=0), high.clamp(min=0)
        scale = ((high - low).clamp(min=1e-5) / 15).half()
        s = scale.float()
        zero = torch.round(-low / s).clamp(0, 15)
        qs.append((torch.round(group / s[:, None]) + zero[:, None]).clamp(0, 15))
        zeros.append(zero)
        scales.append(scale)
    return GroupQuantized(torch.cat(qs, dim=1).numpy().astype(np.uint32),
                          torch.stack(zeros, dim=1).numpy().astype(np.uint32), torch.stack(scales, dim=1).numpy())


def pack_eight(values: np.ndarray, axis: int, order: tuple[int, ...] = tuple(range(8))) -> np.ndarray:
    """Eight 4-bit values per int32 along ``axis``: nibble k (bits 4k..4k+3) of packed index j
    holds value ``8 j + order[k]``."""
    v = np.moveaxis(values.astype(np.uint32), axis, -1)
    v = v.reshape(*v.shape[:-1], v.shape[-1] // 8, 8)
    packed = np.zeros(v.shape[:-1], dtype=np.uint32)
    for k, source in enumerate(order):
        packed |= v[..., source] << np.uint32(4 * k)
    return np.ascontiguousarray(np.moveaxis(packed, -1, axis)).view(np.int32)


def gptq_tensors(w: torch.Tensor, group_size: int, checkpoint_format: str = "gptq",
                 g_idx: np.ndarray | None = None) -> dict[str, torch.Tensor]:
    """One Linear as GPTQ writes it. v1 ("gptq") stores zero - 1, clamped at 0 as GPTQModel
    does (AutoGPTQ wraps it to 15 instead: a zero of 0 cannot be stored in v1)."""
    quantized = quantize_rtn(w, group_size, range_includes_zero=True)
    stored_zeros = quantized.zeros
    if checkpoint_format != "gptq_v2":
        stored_zeros = np.maximum(stored_zeros.astype(np.int64) - 1, 0)
    in_features = w.shape[1]
    if g_idx is None:
        g_idx = np.arange(in_features) // group_size
    return {
        "qweight": torch.from_numpy(pack_eight(quantized.q.T, axis=0)),  # [in/8, out]
        "qzeros": torch.from_numpy(pack_eight(stored_zeros.T, axis=1)),  # [in/G, out/8]
        "scales": torch.from_numpy(np.ascontiguousarray(quantized.scales.T)),  # [in/G, out]
        "g_idx": torch.from_numpy(g_idx.astype(np.int32)),  # [in]
    }


def awq_tensors(w: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """One Linear as AutoAWQ's WQLinear_GEMM stores it (which needs G to divide the input size)."""
    if w.shape[1] % group_size:
        raise ValueError(f"AWQ needs the input size {w.shape[1]} to be a multiple of the group size {group_size}")
    quantized = quantize_rtn(w, group_size, range_includes_zero=False)
    return {
        "qweight": torch.from_numpy(pack_eight(quantized.q.T, axis=1, order=AWQ_PACK_ORDER)),  # [in, out/8]
        "qzeros": torch.from_numpy(pack_eight(quantized.zeros.T, axis=1, order=AWQ_PACK_ORDER)),  # [in/G, out/8]
        "scales": torch.from_numpy(np.ascontiguousarray(quantized.scales.T)),  # [in/G, out]
    }


def quantization_config(method: str, group_size: int, checkpoint_format: str = "gptq",
                        desc_act: bool = False) -> dict:
    """config.json's quantization_config as optimum/GPTQModel (gptq) or AutoAWQ (awq) write it."""
    if method == "gptq":
        return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": False,
                "true_sequential": True, "damp_percent": 0.01, "checkpoint_format": checkpoint_format,
                "lm_head": False, "meta": {"quantizer": ["tandem-tests:rtn"]}}
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": None}


def write_quantized_checkpoint(hf_model, tokenizer, directory: str, method: str, group_size: int = 128,
                               checkpoint_format: str = "gptq", max_shard_bytes: int | None = None,
                               g_idx_of=None) -> None:
    """Write ``hf_model`` (a transformers Llama-family model) to ``directory`` as a GPTQ or
    AWQ checkpoint. max_shard_bytes: split into shards with an index. g_idx_of(module name,
    in_features) -> g_idx overrides GPTQ's group of each input channel (the tensor only: the
    values are still quantized in contiguous groups)."""
    os.makedirs(directory, exist_ok=True)
    config = hf_model.config
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in hf_model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if module.endswith(PROJECTIONS) and leaf == "weight":
            if method == "gptq":
                g_idx = g_idx_of(module, tensor.shape[1]) if g_idx_of else None
                packed = gptq_tensors(tensor, group_size, checkpoint_format, g_idx)
            else:
                packed = awq_tensors(tensor, group_size)
            tensors.update({f"{module}.{key}": value for key, value in packed.items()})
        elif name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # tied: stored once, as the embedding
        else:
            tensors[name] = tensor.detach().half().contiguous()
    _save_safetensors(tensors, directory, max_shard_bytes)
    config_dict = config.to_dict()
    config_dict["quantization_config"] = quantization_config(method, group_size, checkpoint_format,
                                                             desc_act=g_idx_of is not None)
    config_dict["dtype"] = "float16"
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config_dict, f, indent=2)
    hf_model.generation_config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def _save_safetensors(tensors: dict[str, torch.Tensor], directory: str, max_shard_bytes: int | None) -> None:
    """model.safetensors, or shards of at most max_shard_bytes (one tensor may exceed it) and their index."""
    if max_shard_bytes is None:
        safetensors.torch.save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        safetensors.torch.save_file(shard, os.path.join(directory, filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, filename))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(directory, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


# --- reading back, in numpy by the same definitions (independent of tandem/model/gptq_awq.py)


def read_tensors(directory: str) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint (all shards), as numpy."""
    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            with safetensors.safe_open(os.path.join(directory, name), framework="np") as f:
                out.update({key: f.get_tensor(key) for key in f.keys()})
    return out


def nibbles(packed: np.ndarray) -> list[np.ndarray]:
    """The eight 4-bit fields of each int32, field k = bits 4k..4k+3."""
    bits = packed.view(np.uint32)
    return [((bits >> np.uint32(4 * k)) & np.uint32(15)).astype(np.int64) for k in range(8)]


def reference_int4(tensors: dict[str, np.ndarray], module: str, method: str, checkpoint_format: str):
    """-> (q [out, in], zero [out, in], scale [out, in] float64), each input channel with its own group's values."""
    packed_w, packed_z = tensors[module + ".qweight"], tensors[module + ".qzeros"]
    scales = tensors[module + ".scales"].astype(np.float64)  # [groups, out]
    if method == "gptq":  # input channel 8r + k in field k of row r; zeros along the output, in order
        rows, out_features = packed_w.shape
        q = np.zeros((rows * 8, out_features), np.int64)
        z = np.zeros((packed_z.shape[0], out_features), np.int64)
        for k, field in enumerate(nibbles(packed_w)):
            q[k::8] = field
        for k, field in enumerate(nibbles(packed_z)):
            z[:, k::8] = field
        z += 1 if checkpoint_format == "gptq" else 0  # v1 stores zero - 1
        group = tensors[module + ".g_idx"].astype(np.int64)  # the group of each input channel, as GPTQ kernels read it
    else:  # output channel 8c + AWQ_PACK_ORDER[k] in field k of column c, for weights and zeros alike
        in_features, cols = packed_w.shape
        q = np.zeros((in_features, cols * 8), np.int64)
        z = np.zeros((packed_z.shape[0], cols * 8), np.int64)
        for k, (fw, fz) in enumerate(zip(nibbles(packed_w), nibbles(packed_z))):
            q[:, AWQ_PACK_ORDER[k]::8], z[:, AWQ_PACK_ORDER[k]::8] = fw, fz
        group = np.arange(in_features) // (in_features // scales.shape[0])
    return q.T, z[group].T, scales[group].T


def int4_form(q: np.ndarray, z: np.ndarray, s: np.ndarray) -> np.ndarray:
    """``(q - zero) * scale`` in Int4Weight's documented form: ``q * scale + offset`` with
    ``offset = -zero * scale`` rounded to float16 (float64; exact in float32)."""
    return q * s + (-z * s).astype(np.float16).astype(np.float64)


def set_checkpoint_weights(hf_model, directory: str, method: str, checkpoint_format: str) -> None:
    """Give a transformers model the checkpoint's weights by the numpy reference (int4_form)."""
    tensors = read_tensors(directory)
    with torch.no_grad():
        for name, param in hf_model.state_dict().items():
            module = name.removesuffix(".weight")
            if module + ".qweight" in tensors:
                param.copy_(torch.from_numpy(int4_form(*reference_int4(tensors, module, method, checkpoint_format))))
            elif name in tensors:
                param.copy_(torch.from_numpy(tensors[name].astype(np.float32)))
