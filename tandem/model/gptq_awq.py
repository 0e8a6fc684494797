"""GPTQ and AWQ 4-bit checkpoints from a local Hugging Face directory, taken into Int4Weight exactly.

Both formats store ``w = (q - zero) * scale`` per group of ``G`` input channels, with ``q``
and ``zero`` in 0..15 packed eight to an int32 and ``scale`` in float16; they differ in
what is packed along which axis:

- GPTQ (AutoGPTQ, GPTQModel, optimum): ``qweight`` int32 [in / 8, out] packed along the
  input (input channel ``8 r + k`` in bits ``4k..4k+3`` of row ``r``); ``qzeros`` int32
  [in / G, out / 8] packed along the output, in order; ``scales`` float16 [in / G, out];
  ``g_idx`` int32 [in], the group of each input channel; when G does not divide ``in`` the
  last group is shorter (Int4Weight then gets groups of gcd(G, in) sharing each scale and
  zero: exact, with more scales stored). ``checkpoint_format`` "gptq" (v1,
  the default) stores ``zero - 1`` (clamped at 0), so ``zero = stored + 1``: the classic
  off-by-one that every v1 kernel adds back; "gptq_v2" stores the zero itself.
- AWQ "gemm" (AutoAWQ): ``qweight`` int32 [in, out / 8] packed along the output in AWQ's
  interleaved order: nibble ``k`` holds output channel ``8 c + [0, 2, 4, 6, 1, 3, 5, 7][k]``;
  ``qzeros`` int32 [in / G, out / 8] in the same order; ``scales`` float16 [in / G, out].
  Zeros are stored as they are.

Int4Weight keeps ``q`` and ``scale`` bit for bit and ``offset = -zero * scale``: the product
is exact in float32 (at most 11 + 5 bits) and is rounded once to the float16 that Int4Weight
stores, so a dequantized value differs from ``(q - zero) * scale`` by at most half a float16
ulp of ``zero * scale``: 2^-7 of the group's step at most (zero <= 16). ``sym`` only changes
what the zeros hold (8, stored as 7 in v1), so it needs nothing here.

GPTQ with ``desc_act`` (act-order) assigns groups to input channels in activation order
(``g_idx`` not ``i // G``). Int4Weight's groups are contiguous runs of input channels, and
permuting the input channels instead would need the activations permuted per layer (and
breaks row-parallel slicing), so such a checkpoint is refused with the file and tensor named.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
from dataclasses import dataclass

import torch

from tandem.config import ModelConfig
from tandem.model.checkpoint import SafetensorsCheckpoint, checkpoint_config, weights_from_checkpoint
from tandem.model.int4 import Int4Weight
from tandem.model.llama import ModelWeights
from tandem.model.loaded import LoadedModel, load_hf_config
from tandem.model.quantization import Weight
from tandem.model.source import ModelSource

logger = logging.getLogger(__name__)

SUPPORTED_METHODS = ("gptq", "awq")
GPTQ_FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> what to add to a stored zero
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble k of an AWQ int32 holds output channel AWQ_ORDER[k] of its 8
# Byte b of an AWQ int32 holds nibbles 2b (low) and 2b + 1 (high), so these output channels:
_AWQ_LOW_NIBBLE_CHANNELS = list(AWQ_ORDER[0::2])  # [0, 4, 1, 5]
_AWQ_HIGH_NIBBLE_CHANNELS = list(AWQ_ORDER[1::2])  # [2, 6, 3, 7]


@dataclass(frozen=True)
class Int4CheckpointFormat:
    """What config.json's ``quantization_config`` says about the packed tensors."""

    method: str  # "gptq" | "awq"
    group_size: int | None  # None: one group per row (group_size -1)
    zero_offset: int  # added to every stored zero: 1 for GPTQ v1, else 0
    desc_act: bool


def read_quantization_config(directory: str) -> dict | None:
    """config.json's ``quantization_config`` (None when the directory has none)."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f).get("quantization_config")


def parse_quantization_config(qc: dict, where: str) -> Int4CheckpointFormat:
    """Validate a GPTQ/AWQ ``quantization_config`` (ValueError naming ``where`` and the setting)."""
    method = str(qc.get("quant_method", "")).lower()
    if method not in SUPPORTED_METHODS:
        raise ValueError(f"{where}: quantization_config.quant_method {qc.get('quant_method')!r} is not supported: "
                         f"tandem loads {' and '.join(SUPPORTED_METHODS)} checkpoints (4-bit)")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{where}: quantization_config.bits is {bits!r}: "
                         f"tandem loads {method} checkpoints of 4 bits only")
    group_size = qc.get("group_size", qc.get("q_group_size"))
    if not isinstance(group_size, int) or (group_size != -1 and (group_size <= 0 or group_size % 2)):
        raise ValueError(f"{where}: quantization_config.group_size {group_size!r} must be -1 or a positive even number")
    if qc.get("dynamic"):
        raise ValueError(f"{where}: quantization_config.dynamic (per-module bits or group sizes) is not supported")
    if method == "gptq":
        fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
        if fmt not in GPTQ_FORMATS or qc.get("is_marlin_format"):
            raise ValueError(f"{where}: GPTQ checkpoint_format {fmt!r} is not supported: tandem reads "
                             f"{', '.join(GPTQ_FORMATS)} (repack marlin/bitblas checkpoints to gptq)")
        if str(qc.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
            raise ValueError(f"{where}: GPTQ pack_dtype {qc['pack_dtype']!r} is not supported: only int32")
        zero_offset, desc_act = GPTQ_FORMATS[fmt], bool(qc.get("desc_act", False))
    else:
        version = str(qc.get("version") or qc.get("format") or "gemm").lower()
        if version != "gemm":
            raise ValueError(f"{where}: AWQ version {version!r} is not supported: tandem reads AWQ 'gemm' checkpoints")
        if not qc.get("zero_point", True):
            raise ValueError(f"{where}: AWQ zero_point false is not supported (AutoAWQ's gemm format has zero points)")
        zero_offset, desc_act = 0, False
    return Int4CheckpointFormat(method, None if group_size == -1 else group_size, zero_offset, desc_act)


def _bytes(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] int32 -> [..., n, 4] uint8, byte b = bits 8b..8b+7: nibble 2b low, 2b + 1 high."""
    if sys.byteorder == "little":  # the words' bytes in memory are in that order already
        return packed.contiguous().view(torch.uint8).reshape(*packed.shape, 4)
    return torch.stack([(packed >> (8 * b)) & 0xFF for b in range(4)], dim=-1).to(torch.uint8)


def _int4_weight(qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group_size: int,
                 where: str) -> Int4Weight:
    """qweight: [out, in / 2] uint8 (Int4Weight's packing); zeros: [out, ceil(in / G)] integers;
    scales: [out, ceil(in / G)] float16 -> Int4Weight."""
    in_features = qweight.shape[1] * 2
    if in_features % group_size:
        # GPTQ allows a last, shorter group (in % G != 0), Int4Weight's groups are all whole:
        # cut every group into runs of gcd(G, in) channels that share its scale and zero (exact).
        run = math.gcd(group_size, in_features)
        if run % 2:
            raise ValueError(f"{where}: {in_features} input channels in groups of {group_size} leave runs of {run}, "
                             "not the even group size int4 packing needs")
        zeros = zeros.repeat_interleave(group_size // run, dim=1)[:, :in_features // run]
        scales = scales.repeat_interleave(group_size // run, dim=1)[:, :in_features // run]
        group_size = run
    offset = (-(zeros.float() * scales.float())).half()  # exact in float32, rounded once to float16
    return Int4Weight(qweight, scales.contiguous(), offset.contiguous(), group_size)


def _packed_tensors(ckpt: SafetensorsCheckpoint, module: str, fmt: Int4CheckpointFormat,
                    in_features_of, out_features_of) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, int, int]:
    """-> (qweight, qzeros, scales, in_features, out_features, group size), shapes checked."""
    qweight, qzeros = ckpt.get(module + ".qweight"), ckpt.get(module + ".qzeros")
    scales = ckpt.get(module + ".scales")  # [groups, out]
    in_features, out_features = in_features_of(qweight), out_features_of(qweight)
    group_size = fmt.group_size or in_features
    num_groups = -(-in_features // group_size)
    if (qweight.dtype != torch.int32 or qzeros.dtype != torch.int32 or scales.dtype != torch.float16
            or scales.shape != (num_groups, out_features) or qzeros.shape != (num_groups, out_features // 8)):
        layout = "[in/8, out], [in/G, out/8]" if fmt.method == "gptq" else "[in, out/8], [in/G, out/8]"
        raise ValueError(f"{ckpt.where(module + '.qweight')}: qweight {qweight.dtype} {tuple(qweight.shape)}, "
                         f"qzeros {qzeros.dtype} {tuple(qzeros.shape)}, scales {scales.dtype} {tuple(scales.shape)} "
                         f"are not 4-bit {fmt.method} of group size {group_size} (int32 {layout}; "
                         "float16 scales [in/G, out])")
    return qweight, qzeros, scales, in_features, out_features, group_size


def gptq_to_int4(ckpt: SafetensorsCheckpoint, module: str, fmt: Int4CheckpointFormat) -> Int4Weight:
    """The GPTQ tensors of ``module`` (e.g. "model.layers.0.mlp.down_proj") as an Int4Weight."""
    # qweight: [in/8, out]; qzeros: [in/G, out/8]; scales: [in/G, out]
    qweight, qzeros, scales, in_features, out_features, group_size = _packed_tensors(
        ckpt, module, fmt, lambda qw: qw.shape[0] * 8, lambda qw: qw.shape[1])
    if module + ".g_idx" in ckpt:
        g_idx = ckpt.get(module + ".g_idx").long()  # [in]
        if not torch.equal(g_idx, torch.arange(in_features) // group_size):
            raise ValueError(
                f"{ckpt.where(module + '.g_idx')}: input channels are grouped in activation order "
                f"(desc_act={fmt.desc_act}): tandem's int4 groups are contiguous input channels, so act-order "
                "GPTQ checkpoints are not supported; quantize with desc_act=false")
    # Byte b of word r holds input channels 8r + 2b (low nibble) and 8r + 2b + 1 (high): read
    # as bytes along the input, GPTQ's words already are Int4Weight's packing, transposed.
    packed = _bytes(qweight.T).reshape(out_features, in_features // 2)  # [out, in/2]
    by_byte = _bytes(qzeros)  # [in/G, out/8, 4]: output channel 8c + 2b low, 8c + 2b + 1 high
    zeros = torch.stack((by_byte & 0xF, by_byte >> 4), dim=-1).reshape(-1, out_features).int() + fmt.zero_offset
    return _int4_weight(packed, zeros.T, scales.T, group_size, ckpt.where(module + ".qweight"))


def awq_to_int4(ckpt: SafetensorsCheckpoint, module: str, fmt: Int4CheckpointFormat) -> Int4Weight:
    """The AWQ (gemm) tensors of ``module`` as an Int4Weight."""
    # qweight: [in, out/8]; qzeros: [in/G, out/8]; scales: [in/G, out]
    qweight, qzeros, scales, in_features, out_features, group_size = _packed_tensors(
        ckpt, module, fmt, lambda qw: qw.shape[0], lambda qw: qw.shape[1] * 8)

    def by_channel(packed: torch.Tensor) -> torch.Tensor:  # [rows, out/8] int32 -> [rows, out] uint8, channel order
        by_byte = _bytes(packed)  # [rows, out/8, 4]
        q = torch.empty(*packed.shape, 8, dtype=torch.uint8)
        q[..., _AWQ_LOW_NIBBLE_CHANNELS] = by_byte & 0xF
        q[..., _AWQ_HIGH_NIBBLE_CHANNELS] = by_byte >> 4
        return q.reshape(packed.shape[0], out_features)

    q = by_channel(qweight)  # [in, out]
    packed = (q[0::2] | (q[1::2] << 4)).T.contiguous()  # [out, in/2]: Int4Weight's packing, low nibble first
    return _int4_weight(packed, by_channel(qzeros).T, scales.T, group_size, ckpt.where(module + ".qweight"))


_TO_INT4 = {"gptq": gptq_to_int4, "awq": awq_to_int4}


def weights_from_int4_checkpoint(ckpt: SafetensorsCheckpoint, fmt: Int4CheckpointFormat, config: ModelConfig,
                                 hf_config, dtype: torch.dtype) -> ModelWeights:
    """ModelWeights whose quantized projections are Int4Weight and the rest ``dtype``."""

    def projection(module: str) -> Weight:  # modules left in float (modules_to_not_convert, lm_head) stay float
        if module + ".qweight" in ckpt:
            return _TO_INT4[fmt.method](ckpt, module, fmt)
        return ckpt.get(module + ".weight").to(dtype).contiguous()

    return weights_from_checkpoint(ckpt, config, hf_config, dtype, projection)


def is_quantized_checkpoint(source: ModelSource) -> bool:
    """Whether ``source`` is a directory whose config.json declares a quantization (GPTQ, AWQ or
    another, which load_quantized_checkpoint then refuses by name)."""
    return source.gguf_file is None and read_quantization_config(source.path) is not None


def load_quantized_checkpoint(source: ModelSource, dtype: torch.dtype) -> LoadedModel:
    """Load a GPTQ or AWQ directory: config and quantization settings are checked before any
    weight is read; projections become Int4Weight, everything else ``dtype``."""
    qc = read_quantization_config(source.path)
    assert qc is not None, "is_quantized_checkpoint(source) first"
    fmt = parse_quantization_config(qc, os.path.join(source.path, "config.json"))
    hf_config = load_hf_config(source)
    logger.info("loading %s (%s, %s int4, group size %s) from %s", source.name, hf_config.architectures[0],
                fmt.method, fmt.group_size or "whole rows", source.path)
    config, tokenizer = checkpoint_config(source, hf_config)
    weights = weights_from_int4_checkpoint(SafetensorsCheckpoint(source.path), fmt, config, hf_config, dtype)
    return LoadedModel(config, weights, tokenizer)
