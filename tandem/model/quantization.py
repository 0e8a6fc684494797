"""Weight-only int8 quantization: symmetric, one scale per output channel.

A weight ``w: [out, in]`` becomes ``q: [out, in]`` int8 and ``scale: [out]`` with
``scale = max|w[o]| / 127`` and ``q = round(w / scale)``, so that ``|w - q * scale| <= scale / 2``
elementwise. Because the scale belongs to the output channel, ``x @ (q * scale).T`` is
exactly ``(x @ q.T) * scale``: the matrix product runs on the int8 values and the scales
are applied to its (small) output.

Kernels, measured on this machine's CPU (AMD EPYC, AVX512 with bf16 dot products; torch
2.13, 2 threads; microseconds, best of 10), for M rows of activations:

    one SmolLM2-135M layer (qkv 960x576 + o 576x576 + gate_up 3072x576 + down 576x1536)
    M                                 1      8     16     32     64    256
    float32 F.linear                211    652    946   1576   2769  10278
    int8, dequantize to float32     332    846   1195   1775   2974  10474
    int8, _weight_int8pack_mm f32  1287  10355      -      -      -      -
    int8, _weight_int8pack_mm bf16   84    232    439    854   1685   7050  <- M <= 24
    int8, dequantize to bf16        440    463    546    704   1023   2782  <- M > 24
    bfloat16 F.linear               194    218    287    432    707   2262
    LM head 49152x576
    float32 F.linear               8052  12475  12786  22915  31977 106868
    int8, dequantize to float32   39175  45741  45015  56082  69567 161179
    int8, _weight_int8pack_mm bf16  963   2269   4272   9462  16781 117333  <- M <= 128
    int8, dequantize to bf16      21054  21110  21520  21827  24380  69040  <- M > 128

(float32 activations; with bf16 activations the int8 rows are the same within 2%.)
Dequantizing on the fly writes and re-reads a float copy of the weight, so it never beats
the float weight at decode sizes; dequantizing to float32 is never faster than float32.
torch's weight-only kernel ``_weight_int8pack_mm`` reads the int8 weight directly: 2.5x
(layers) to 8x (LM head) faster than float32 for one token, but its float32 variant is
unvectorized (6-16x slower than float32), and from a few tens of rows on a bf16 GEMM on
the dequantized weight wins. So the int8 product always runs in bf16 (float16 for float16
activations: float32 activations are rounded to bf16), the kernel up to KERNEL_MAX_TOKENS
rows (KERNEL_MAX_TOKENS_LARGE for an LM-head-sized weight), the dequantized weight above,
and the float32 scales multiply the float32 result: ``(x @ q.T) * scale``.

int4 (tandem/model/int4.py: groups of 32 values with a float16 scale and offset, GGUF Q4_1's
form) takes torch's int4 kernel ``_weight_int4pack_mm_for_cpu`` up to 160 rows and a bf16
GEMM on the dequantized weight above: measured in int4_matmul.py, side by side with the rows
above (python -m tandem.bench.quantization.kernels). On CUDA (or TANDEM_ATTENTION_BACKEND=triton),
decode-sized products (up to TRITON_MAX_TOKENS rows) of both run the Triton GEMV kernels of
tandem.kernels.ops instead. Under int4 the LM head is int8 (LM_HEAD_METHOD, measured).

The LM head is quantized too (tied or not; a tied embedding table stays in float for the
lookup, which reads a few rows per step). On SmolLM2-135M-Instruct with float32 elsewhere
(tandem bench quant, 1023 tokens of English text teacher-forced): without the head, top-1
agreement with float32 98% and perplexity +0.5%; with it 96% and +0.6..0.8%, for 4x fewer
bytes read per decode step instead of 2.4x and 1.6x the decode tokens/s.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Union

import torch
import torch.nn.functional as F

from tandem.config.names import QUANTIZATION_METHODS
from tandem.kernels import f32_gemv_cpu, int4_gemv_cpu, int8_gemv_cpu, ops
from tandem.kernels.int8_gemv_cpu import Int8GemvPack
from tandem.model.int4 import Int4Weight, quantize_int4
from tandem.model.int4_matmul import GEMV_MAX_TOKENS, int4_matmul

if TYPE_CHECKING:
    from tandem.model.llama import ModelWeights

TRITON_MAX_TOKENS = 16
"""Most rows for which linear() calls the Triton GEMV kernels (decode-sized products)."""

KERNEL_MAX_TOKENS = 24
"""Most rows for which the int8 kernel beats dequantizing a layer's projection (measured: 16 vs 32)."""
KERNEL_MAX_TOKENS_LARGE = 128
LARGE_WEIGHT_NUMEL = 1 << 24
"""From this size (an LM head) dequantizing costs more: the kernel wins up to 128 rows."""


@dataclass(frozen=True)
class Int8Weight:
    """A linear layer's weight, int8 per output channel: ``w ~= qweight * scale[:, None]``."""

    qweight: torch.Tensor  # [out, in] int8
    scale: torch.Tensor  # [out] float32

    @property
    def shape(self) -> torch.Size:
        return self.qweight.shape

    @property
    def num_bytes(self) -> int:
        """Bytes held: the int8 values and the float32 scales."""
        return self.qweight.numel() + self.scale.numel() * self.scale.element_size()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """-> [out, in] in ``dtype`` (scales multiplied in float32 first)."""
        return (self.qweight.float() * self.scale[:, None]).to(dtype)

    @functools.cached_property
    def gemv_pack(self) -> Int8GemvPack:
        """tandem's CPU kernel layout of this weight (kernels/int8_gemv_cpu.py), built once per instance."""
        return int8_gemv_cpu.pack(self.qweight, self.scale)

    def rows(self, start: int, end: int) -> Int8Weight:
        """Output channels ``start:end`` (a column-parallel shard) with their scales."""
        return Int8Weight(self.qweight[start:end].contiguous(), self.scale[start:end].contiguous())

    def cols(self, start: int, end: int) -> Int8Weight:
        """Input channels ``start:end`` (a row-parallel shard): a channel's scale covers all its
        columns, so each shard keeps the whole scale vector (the values are unchanged)."""
        return Int8Weight(self.qweight[:, start:end].contiguous(), self.scale.clone())


Weight = Union[torch.Tensor, Int8Weight, Int4Weight]
QuantizedWeight = Union[Int8Weight, Int4Weight]


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """Symmetric per-output-channel int8 of ``w: [out, in]`` (computed in float32).

    A row of zeros gets scale 0 (and int8 zeros), so it dequantizes to zeros exactly.
    """
    w32 = w.detach().float()
    scale = w32.abs().amax(dim=1) / 127.0  # [out]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w32 / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    return Int8Weight(q.contiguous(), scale.contiguous())


@functools.lru_cache(maxsize=64)
def _ones(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Unit scales for the int8 kernel: the real (float32) scales are applied after it."""
    return torch.ones(n, dtype=dtype, device=device)


def _use_kernel(num_tokens: int, w: Int8Weight) -> bool:
    """Whether torch's int8 kernel beats dequantizing ``w`` for ``num_tokens`` rows (measured)."""
    if w.qweight.device.type != "cpu":  # torch's int8 kernel is a CPU one
        return False
    limit = KERNEL_MAX_TOKENS_LARGE if w.qweight.numel() >= LARGE_WEIGHT_NUMEL else KERNEL_MAX_TOKENS
    return num_tokens <= limit


def uses_gemv(x2: torch.Tensor, w: Int8Weight) -> bool:
    """Whether tandem's CPU int8 kernel runs this product (float32 CPU rows, a shape it takes):
    measured 1.2x torch's kernel at 1 row and 2x at 8 to 32 (LM head and layer shapes), so up
    to the int4 kernel's bound."""
    return (x2.dtype == torch.float32 and x2.device.type == "cpu" and x2.shape[0] <= GEMV_MAX_TOKENS
            and w.qweight.device.type == "cpu" and int8_gemv_cpu.takes(*w.shape)
            and int8_gemv_cpu.load_extension() is not None)


def int8_matmul(x2: torch.Tensor, w: Int8Weight, use_kernel: bool | None = None) -> torch.Tensor:
    """x2: [M, in] float -> [M, out] float32: ``x2 @ (qweight * scale[:, None]).T``.

    The product runs in bf16 (float16 for float16 activations): float32 activations are
    rounded to bf16, the int8 values are exact in it, and the scales multiply the result in
    float32; except that float32 activations on the CPU take tandem's kernel (uses_gemv), in
    float32 throughout. use_kernel None: the faster way for M (see the table above).
    """
    if use_kernel is None and uses_gemv(x2, w):
        return w.gemv_pack.matmul(x2)
    xc = x2 if x2.dtype in (torch.bfloat16, torch.float16) else x2.to(torch.bfloat16)
    if use_kernel is None:
        use_kernel = _use_kernel(x2.shape[0], w)
    if use_kernel:
        out = torch._weight_int8pack_mm(xc.contiguous(), w.qweight, _ones(w.qweight.shape[0], xc.dtype, xc.device))
    else:
        out = F.linear(xc, w.qweight.to(xc.dtype))
    return out.float() * w.scale


def quantized_matmul(x2: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """x2: [M, in] float -> [M, out] float32 for an int8 or int4 weight.

    Decode-sized products (M <= TRITON_MAX_TOKENS) run the Triton GEMV kernels where the
    kernel dispatch says Triton (CUDA tensors, or TANDEM_ATTENTION_BACKEND=triton); every
    other product takes the torch paths measured above.
    """
    pack = vars(w).get("gemv_pack")  # made as a float32 CPU engine starts (pack_for_cpu_kernels)
    if pack is not None and x2.dtype == torch.float32 and x2.shape[0] <= GEMV_MAX_TOKENS:
        return pack.matmul(x2)  # what the paths below pick too, without their checks on every call
    if x2.shape[0] <= TRITON_MAX_TOKENS and ops.backend_for(x2) is ops.Backend.TRITON:
        if isinstance(w, Int4Weight):
            return ops.int4_gemv(x2, w.qweight, w.scale, w.offset, w.group_size)
        return ops.int8_gemv(x2, w.qweight, w.scale)
    if isinstance(w, Int4Weight):
        return int4_matmul(x2, w)
    return int8_matmul(x2, w)


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` for a float weight (tandem's float32 kernel for a few float32 CPU
    rows, f32_gemv_cpu.py: the same product summed in another order), or the int8/int4 product.

    x: [..., in]; w: [out, in]; bias: [out] -> [..., out] in x's dtype.
    """
    if isinstance(w, torch.Tensor):
        x2 = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
        if not f32_gemv_cpu.uses_kernel(x2, w):
            return F.linear(x, w, bias)
        out = f32_gemv_cpu.matmul(x2, w)  # [M, out]
        if bias is not None:
            out = out + bias
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out.shape[-1])
    # out: [M, out] float32
    out = quantized_matmul(x if x.dim() == 2 else x.reshape(-1, x.shape[-1]), w)
    if bias is not None:
        out = out + bias
    if out.dtype != x.dtype:
        out = out.to(x.dtype)
    return out if x.dim() == 2 else out.reshape(*x.shape[:-1], out.shape[-1])


def weight_bytes(w: Weight) -> int:
    """Bytes a weight holds (values + scales (+ offsets) for a quantized one; an int4
    weight's CPU kernel layout is another copy of the same bytes, of which a product reads one)."""
    if isinstance(w, (Int8Weight, Int4Weight)):
        return w.num_bytes
    return w.numel() * w.element_size()


def weight_key(w: Weight) -> int:
    """Identifies the storage of a weight (tied weights share one)."""
    return (w.qweight if isinstance(w, (Int8Weight, Int4Weight)) else w).data_ptr()


def with_cpu_pack(w: Int4Weight) -> Int4Weight:
    """``w``, torch's CPU kernel layout built now (where it has one) so that the first decode
    step does not pay for it."""
    if w.has_cpu_kernel:
        w.cpu_pack  # noqa: B018 (a cached property: built once, kept on the instance)
    return w


def pack_for_cpu_kernels(weights: ModelWeights, device: torch.device, dtype: torch.dtype,
                         activation_quantization: str = "none") -> None:
    """Build tandem's CPU kernel layouts of the quantized weights now, where an engine on
    `device` in `dtype` will run them (float32 on the CPU, unless Triton is asked for), so the
    first step does not pay. activation_quantization: EngineConfig.activation_quantization; int8
    where this CPU lacks AVX-512 VNNI is a ValueError."""
    if device.type != "cpu" or dtype != torch.float32 or ops.requested_backend() is ops.Backend.TRITON:
        return
    int8_activations = activation_quantization == "int8"
    if int8_activations and not int4_gemv_cpu.has_int8_dot():
        raise ValueError("activation_quantization int8 needs a CPU with AVX-512 VNNI (and the compiled kernels); "
                         "this one keeps float32 activations (activation_quantization none)")
    for layer in weights.layers:
        for w in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj):
            _pack_for_gemv(w, int8_activations)
    _pack_for_gemv(weights.lm_head, int8_activations)


def _pack_for_gemv(w: Weight, int8_activations: bool) -> None:
    # NOTE: a pack is a cached property (kept in the instance's dict, as functools keeps it on a
    # frozen dataclass), set here to the pack of this engine's choice of activations (the same
    # tensors): engines sharing one weight object share the choice of the last one built.
    if isinstance(w, Int4Weight) and int4_gemv_cpu.takes(w.shape[0], w.shape[1], w.group_size):
        if int4_gemv_cpu.load_extension() is not None:
            vars(w)["gemv_pack"] = dataclasses.replace(w.gemv_pack, int8_activations=int8_activations)
            # float32 products never read torch's layout (tandem's kernel, or dequantizing above its bound)
            w.__dict__.pop("cpu_pack", None)
    elif isinstance(w, Int8Weight) and int8_gemv_cpu.takes(*w.shape):
        if int8_gemv_cpu.load_extension() is not None:
            rounded = int8_activations and int8_gemv_cpu.takes_int8_activations(w.shape[1])
            vars(w)["gemv_pack"] = dataclasses.replace(w.gemv_pack, int8_activations=rounded)


QUANTIZERS: dict[str, tuple[type[Int8Weight] | type[Int4Weight], Callable[[torch.Tensor], QuantizedWeight]]] = {
    "int8": (Int8Weight, quantize_int8),
    "int4": (Int4Weight, lambda w: with_cpu_pack(quantize_int4(w))),
}
LM_HEAD_METHOD = {"int8": "int8", "int4": "int8"}
"""How each method quantizes the LM head. int4's is int8: on SmolLM2-135M-Instruct (1024
tokens of English, float32 elsewhere) an int4 head costs +5.8% perplexity against float32
and an int8 one -0.05%, for 95 instead of 84 MB read per decode step; GGUF files keep their
output tensor at 8 bits or more too (the default file: Q8_0)."""


def _quantize(w: Weight, method: str) -> QuantizedWeight:
    kind, quantize = QUANTIZERS[method]
    if isinstance(w, kind):
        return w  # already quantized: kept
    if not isinstance(w, torch.Tensor):
        raise ValueError(f"cannot quantize a {type(w).__name__} to {method}: start from the float weights")
    return quantize(w)


def quantize_lm_head(w: Weight, method: str) -> Weight:
    """The LM head as ``method`` quantizes it (LM_HEAD_METHOD); one quantized already is kept."""
    return w if not isinstance(w, torch.Tensor) else _quantize(w, LM_HEAD_METHOD[method])


def quantize_weights(weights: ModelWeights, method: str | None, lm_head: bool | str = True) -> ModelWeights:
    """A copy of ``weights`` whose projections are quantized (``weights`` itself is untouched).

    q/k/v, o, gate/up and down of every layer are quantized (int8: per output channel;
    int4: groups of 32 columns, min/max as GGUF's Q4_1); embeddings, norms and biases stay
    in float. The LM head is quantized by LM_HEAD_METHOD[method] (lm_head True), by the
    method ``lm_head`` names, or not at all (False). A weight quantized already is kept as
    it is (e.g. Q4_1 blocks taken from a GGUF file: see gguf_q4.py). ``method`` None: ``weights``.
    """
    if method is None:
        return weights
    for m in (method, lm_head if isinstance(lm_head, str) else method):
        if m not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} or None, got {m!r}")
    head_method = (LM_HEAD_METHOD[method] if lm_head is True else lm_head) or None
    kind = QUANTIZERS[method][0]
    targets = [w for layer in weights.layers
               for w in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)]
    head_done = head_method is None or not isinstance(weights.lm_head, torch.Tensor)
    if head_done and all(isinstance(w, kind) for w in targets):
        return weights
    layers = [
        dataclasses.replace(layer, qkv_proj=_quantize(layer.qkv_proj, method), o_proj=_quantize(layer.o_proj, method),
                            gate_up_proj=_quantize(layer.gate_up_proj, method),
                            down_proj=_quantize(layer.down_proj, method))
        for layer in weights.layers
    ]
    # A head quantized already (any kind: a GGUF file's Q4_1 output tensor, say) is kept.
    head = weights.lm_head if head_done or head_method is None else _quantize(weights.lm_head, head_method)
    return dataclasses.replace(weights, layers=layers, lm_head=head)
