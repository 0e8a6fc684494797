"""Weight-only int4 (groups of 32 with a float16 scale and offset): the quantization's error
bound, every CPU product path against float64, the dispatch to the Triton GEMV kernels,
exact weight bytes, and on the default model how close int4 stays to float32."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from reference import english_token_ids

from tandem import SamplingParams
from tandem.bench.quant import forced_agreement, perplexity
from tandem.model import int4_matmul as int4_paths
from tandem.model.int4 import Int4Weight, pack_int4, quantize_int4
from tandem.model.quantization import (
    Int8Weight,
    linear,
    quantize_int8,
    quantize_weights,
    quantized_matmul,
    weight_bytes,
    weight_key,
)

U32 = 2.0 ** -24  # float32 unit roundoff
BF16_U = 2.0 ** -8  # bfloat16's machine epsilon: twice its unit roundoff, for margin
FP16_U = 2.0 ** -11  # float16's unit roundoff


def random_weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """Rows of very different magnitudes, a row of zeros, a constant group and an outlier."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) * torch.logspace(-3, 0, out_features)[:, None]
    w[3] = 0.0
    w[5, :32] = 0.25  # a constant group: scale 0
    w[7, 40] = 8.0  # one large value stretches its group's scale
    return w


def test_quantize_int4_error_bound():
    w = random_weight(64, 256)
    q = quantize_int4(w)
    assert q.qweight.dtype == torch.uint8 and q.qweight.shape == (64, 128)
    assert q.scale.shape == q.offset.shape == (64, 8) and q.scale.dtype == q.offset.dtype == torch.float16
    groups = w.double().reshape(64, 8, 32)
    low, high = groups.amin(-1), groups.amax(-1)
    scale, offset = q.scale.double(), q.offset.double()
    # The definition in float64: scale = (max - min) / 15 and offset = min, each rounded to float16.
    assert bool(((scale - (high - low) / 15).abs() <= scale * FP16_U + 2.0 ** -25).all())
    assert bool(((offset - low).abs() <= low.abs() * FP16_U).all())
    # Round to nearest against the stored scale: half a step, plus what rounding the scale
    # and the offset to float16 moves the ends of the grid (15 steps of the scale's rounding).
    bound = scale / 2 + 15 * (scale - (high - low) / 15).abs() + (offset - low).abs() + 1e-7 * groups.abs().amax(-1)
    error = (q.dequantize(torch.float64).reshape(64, 8, 32) - groups).abs().amax(-1)
    assert bool((error <= bound).all()), float((error / bound).max())
    assert int(q.unpacked().max()) == 15 and int(q.unpacked().min()) == 0
    assert bool((q.dequantize()[3] == 0).all())  # a zero row stays exactly zero
    assert float(q.scale[5, 0]) == 0.0 and bool((q.dequantize()[5, :32] == 0.25).all())  # constant group: exact


def test_pack_layout_and_shards():
    g = torch.Generator().manual_seed(1)
    values = torch.randint(0, 16, (48, 128), generator=g)
    packed = pack_int4(values)
    assert packed.shape == (48, 64) and bool((packed[:, 5] == values[:, 10] | (values[:, 11] << 4)).all())
    w = Int4Weight(packed, torch.rand(48, 4, generator=g).half(), torch.randn(48, 4, generator=g).half(), 32)
    assert torch.equal(w.unpacked().long(), values)
    full = w.dequantize()
    assert torch.equal(w.rows(16, 40).dequantize(), full[16:40])
    assert torch.equal(w.cols(32, 96).dequantize(), full[:, 32:96])
    with pytest.raises(ValueError, match="group"):
        w.cols(16, 64)
    # Each shard gets its own CPU kernel layout (never one built for the whole weight).
    x = torch.randn(3, 64, generator=g)
    shard = w.rows(16, 48).cols(0, 64)
    expected = x.double() @ full[16:48, :64].double().T
    out = int4_paths.int4_matmul(x, shard, int4_paths.KERNEL)
    assert shard.cpu_pack.values.shape == (32, 32)
    assert bool(((out.double() - expected).abs() <= kernel_bound(x, shard)).all())


def test_int8_rows_and_cols():
    q = quantize_int8(random_weight(40, 64))
    full = q.dequantize()
    assert isinstance(q.rows(8, 24), Int8Weight) and torch.equal(q.rows(8, 24).dequantize(), full[8:24])
    assert isinstance(q.cols(16, 48), Int8Weight) and torch.equal(q.cols(16, 48).dequantize(), full[:, 16:48])


def magnitude(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """|x| @ |w_hat|.T in float64: [M, out]."""
    return x.double().abs() @ w.dequantize(torch.float64).abs().T


def kernel_bound(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """torch's int4 kernel against the exact product with the dequantized weight: x rounded
    to bf16; scale and zero = offset + 8 * scale rounded to bf16, so each weight moves by at
    most u (8 scale + |zero|); the dequantized weight and the result each rounded to bf16
    once more (u = bf16's epsilon, twice its unit roundoff, covers float32 accumulation)."""
    scale = w.scale.double().repeat_interleave(w.group_size, dim=1)
    zero = w.offset.double().repeat_interleave(w.group_size, dim=1) + 8 * scale
    weight_shift = x.double().abs() @ (8 * scale + zero.abs()).T
    return BF16_U * (3 * magnitude(x, w) + weight_shift) + 1e-6


def gemv_bound(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """tandem's float32 kernel: the exact weight's two terms, ``q * scale`` and ``offset``,
    each summed against x in float32 (a group at a time, then the groups): K terms per sum,
    bounded by the terms' own magnitudes (they may cancel in ``w``)."""
    scale = w.scale.double().repeat_interleave(w.group_size, dim=1)
    offset = w.offset.double().repeat_interleave(w.group_size, dim=1)
    terms = x.double().abs() @ (w.unpacked().double() * scale + offset.abs()).T
    return (x.shape[-1] + 4) * U32 * terms + 1e-9


PATH_BOUNDS = {
    int4_paths.GEMV_F32: gemv_bound,
    # float32 GEMM on the exact weight: a dot product of K terms accumulated in float32.
    int4_paths.DEQUANTIZE_F32: lambda x, w: (x.shape[-1] + 2) * U32 * magnitude(x, w) + 1e-9,
    # x and the weight rounded to bf16, float32 accumulation, the result rounded to bf16.
    int4_paths.DEQUANTIZE_BF16: lambda x, w: 3 * BF16_U * magnitude(x, w) + 1e-6,
    int4_paths.KERNEL: kernel_bound,
}


@pytest.mark.parametrize("path", int4_paths.PATHS)
@pytest.mark.parametrize("num_tokens", [1, 16, 65])
def test_each_cpu_path_equals_dequantized_reference(path, num_tokens):
    w = quantize_int4(random_weight(192, 576, seed=num_tokens))
    x = torch.randn(num_tokens, 576, generator=torch.Generator().manual_seed(2))
    out = int4_paths.int4_matmul(x, w, path)
    assert out.dtype == torch.float32 and out.shape == (num_tokens, 192)
    expected = x.double() @ w.dequantize(torch.float64).T
    bound = PATH_BOUNDS[path](x, w)
    error = (out.double() - expected).abs()
    assert bool((error <= bound).all()), float((error / bound).max())
    # Not vacuous: the error is a real fraction of the bound somewhere (float32 excepted: often exact).
    if path != int4_paths.DEQUANTIZE_F32:
        assert float((error / bound).max()) > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 8, 160, 161, 300])  # the kernel up to 160 rows, then dequantized
def test_linear_int4_within_quantization_error_of_float64(num_tokens, dtype):
    w, b = random_weight(160, 576, seed=num_tokens), torch.randn(160) * 0.1
    q = quantize_int4(w)
    x = torch.randn(num_tokens, 576, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = linear(x, q, b.to(dtype))
    assert out.dtype == dtype and out.shape == (num_tokens, 160)
    expected = x.double() @ w.double().T + b.to(dtype).double()  # the float weight, in float64
    # The quantization's own error, bounded elementwise as in test_quantize_int4_error_bound,
    # then the product's (the kernel's bound covers the dequantized-bf16 path too), and for a
    # bf16 result one more rounding.
    quant_error = (q.dequantize(torch.float64) - w.double()).abs()
    bound = (x.double().abs() @ quant_error.T + kernel_bound(x, q)
             + (BF16_U * (expected.abs() + magnitude(x, q)) if dtype == torch.bfloat16 else 0))
    error = (out.double() - expected).abs()
    assert bool((error <= bound).all()), float((error / bound).max())


def test_linear_int4_keeps_leading_dimensions():
    q = quantize_int4(random_weight(32, 64))
    assert linear(torch.randn(2, 3, 64), q).shape == (2, 3, 32)
    assert linear(torch.randn(0, 64), q).shape == (0, 32)


def test_decode_sized_products_go_to_the_triton_gemv_when_triton_is_the_backend(monkeypatch):
    """The dispatch alone: ops says TRITON, so M <= 16 rows call ops.int4_gemv / int8_gemv
    with the weight's own tensors, and M > 16 rows stay on the torch paths."""
    from tandem.kernels import ops

    calls = []
    monkeypatch.setattr(ops, "backend_for", lambda t: ops.Backend.TRITON)

    def recording(kind):
        def gemv(x2, *a):
            calls.append((kind, x2.shape[0], a))
            return x2[:, :32] * 0
        return gemv

    monkeypatch.setattr(ops, "int4_gemv", recording("int4"))
    monkeypatch.setattr(ops, "int8_gemv", recording("int8"))
    q4, q8 = quantize_int4(random_weight(32, 64)), quantize_int8(random_weight(32, 64))
    for m in (1, 16, 17):
        quantized_matmul(torch.randn(m, 64), q4)
        quantized_matmul(torch.randn(m, 64), q8)
    assert [(kind, m) for kind, m, _ in calls] == [("int4", 1), ("int8", 1), ("int4", 16), ("int8", 16)]
    assert calls[0][2] == (q4.qweight, q4.scale, q4.offset, 32) and calls[1][2] == (q8.qweight, q8.scale)


def test_linear_through_triton_interpreter():
    """linear() on the Triton kernels for real (TRITON_INTERPRET=1 on CPU, in a fresh process
    since the interpreter is chosen at import), against the dequantized float64 product."""
    pytest.importorskip("tandem.kernels.int4_gemv_triton")
    script = textwrap.dedent("""
        import torch
        from tandem.model.int4 import quantize_int4
        from tandem.model.quantization import linear, quantize_int8
        g = torch.Generator().manual_seed(0)
        w = torch.randn(48, 128, generator=g) * 0.05
        x = torch.randn(3, 128, generator=g)
        for q in (quantize_int4(w), quantize_int8(w)):
            ref = x.double() @ q.dequantize(torch.float64).T
            bound = 130 * 2.0 ** -24 * (x.double().abs() @ q.dequantize(torch.float64).abs().T) + 1e-6
            assert bool(((linear(x, q).double() - ref).abs() <= bound).all()), type(q).__name__
        print("ok")
    """)
    env = dict(os.environ, TANDEM_ATTENTION_BACKEND="triton", TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_weight_bytes_exact(loaded):
    """Per projection [o, n]: o * n / 2 bytes of values and 2 + 2 bytes of scale and offset
    per 32 of them: 5/8 byte a weight, 5/32 of float32's bytes exactly. The LM head is int8
    (LM_HEAD_METHOD): a byte a weight and a float32 scale per row; or int4 when asked."""
    cfg, float_weights = loaded.config, loaded.weights
    weights = quantize_weights(float_weights, "int4")
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    layers = [(qkv_out, h), (h, cfg.num_heads * cfg.head_dim), (2 * i, h), (h, i)]
    int4_bytes = lambda o, n: o * n // 2 + 4 * o * n // 32  # noqa: E731
    layer_float = 2 * h * 4 + (qkv_out * 4 if cfg.attention_bias else 0)  # norms (and q/k/v biases), float32
    layer_bytes = cfg.num_layers * (sum(int4_bytes(o, n) for o, n in layers) + layer_float) + h * 4
    assert weights.num_bytes == layer_bytes + v * h + 4 * v
    assert isinstance(weights.lm_head, Int8Weight) and isinstance(weights.layers[0].down_proj, Int4Weight)
    all_int4 = quantize_weights(float_weights, "int4", lm_head="int4")
    head = all_int4.lm_head
    assert isinstance(head, Int4Weight) and weight_bytes(head) == int4_bytes(v, h)
    assert all_int4.num_bytes == layer_bytes + int4_bytes(v, h)
    assert weight_key(head) == head.qweight.data_ptr() != weight_key(all_int4.embed_tokens)
    float_projections = 4 * (cfg.num_layers * sum(o * n for o, n in layers) + v * h)
    ratio = (all_int4.num_bytes - cfg.num_layers * layer_float - h * 4) / float_projections
    assert ratio == 5 / 32
    print(f"\nweight bytes read per decode step: float32 {float_weights.num_bytes / 1e6:.1f} MB, int4 "
          f"{weights.num_bytes / 1e6:.1f} MB ({weights.num_bytes / float_weights.num_bytes:.4f}x; int4 head too: "
          f"{all_int4.num_bytes / 1e6:.1f} MB, {all_int4.num_bytes / float_weights.num_bytes:.4f}x)")
    assert all(isinstance(w, torch.Tensor) for layer in float_weights.layers for w in vars(layer).values()
               if w is not None)  # the shared float weights are untouched
    assert quantize_weights(weights, "int4") is weights
    with pytest.raises(ValueError, match="cannot quantize a Int4Weight to int8"):
        quantize_weights(weights, "int8")


@pytest.mark.slow
def test_greedy_agreement_with_float32(make_llm, loaded, tokenizer):
    """Four English prompts x 32 greedy tokens (as the int8 test). forced: the share of
    float32's tokens int4 picks given float32's prefix; same: free-running.

    Measured on this machine: see the print (the figures are in the report of the change
    that added int4). The threshold 0.75 is far above what a broken product gives (a
    wrong nibble order or scales of the wrong groups: near 0%)."""
    prompts = [english_token_ids(tokenizer, 48, skip=300 * k) for k in range(4)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    reference = [o.token_ids for o in make_llm().generate(prompts, params)]
    llm = make_llm(quantization="int4")
    weights = llm.engine.runner.model.weights
    assert isinstance(weights.layers[0].qkv_proj, Int4Weight)
    # A float32 CPU engine runs tandem's int4 and int8 kernels, their layouts made as it started.
    assert "gemv_pack" in vars(weights.layers[0].qkv_proj) and "cpu_pack" not in vars(weights.layers[0].qkv_proj)
    assert isinstance(weights.lm_head, Int8Weight) and "gemv_pack" in vars(weights.lm_head)
    outputs = [o.token_ids for o in llm.generate(prompts, params)]
    same = sum(a == b for out, ref in zip(outputs, reference) for a, b in zip(out, ref)) / (32 * len(prompts))
    forced = forced_agreement(loaded, "float32", prompts, reference, quantization="int4")
    print(f"\nint4 vs float32 greedy, {len(prompts)} prompts x 32 tokens: forced agreement {forced:.1%}, "
          f"same tokens free-running {same:.1%}")
    assert forced >= 0.75


@pytest.mark.slow
def test_perplexity_close_to_float32(loaded, tokenizer):
    """1024 tokens of English text in one prefill. The int4 projections are the file's own
    Q4_1 values (the float32 model is their dequantized copy: test_gguf_q4), so what moves
    the perplexity is the int8 LM head (the Q8_0 table quantized again) and the bf16
    products. The bound 3% is far below what a broken product gives."""
    text = english_token_ids(tokenizer, 1024)
    base = perplexity(loaded, "float32", text)
    quant = perplexity(loaded, "float32", text, quantization="int4")
    print(f"\nperplexity over {len(text)} tokens: float32 {base:.3f}, int4 {quant:.3f} ({quant / base - 1:+.2%})")
    assert abs(quant / base - 1) < 0.03


def test_activation_quantization_lands_on_every_pack_where_the_cpu_takes_it(monkeypatch, loaded):
    """none (the default) keeps float32 activations everywhere; int8 rounds them where the CPU has
    AVX-512 VNNI (as has_int8_dot says) and is refused as the engine starts where it has not. The
    choice lands on each quantized weight's pack, the int8 LM head's too, except where its input
    size is not in groups of 32."""
    from types import SimpleNamespace

    from tandem.config import EngineConfig
    from tandem.kernels import int4_gemv_cpu
    from tandem.model.quantization import pack_for_cpu_kernels

    if int4_gemv_cpu.load_extension() is None:
        pytest.skip("needs the compiled int4 kernel (make install)")
    layer = SimpleNamespace(**{name: quantize_int4(torch.randn(64, 128)) for name in
                               ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")})
    weights = SimpleNamespace(layers=[layer], lm_head=quantize_int8(torch.randn(32, 128)))
    odd_head = SimpleNamespace(layers=[], lm_head=quantize_int8(torch.randn(32, 100)))  # 100 columns: not in 32s

    def chosen(activations: str) -> set[bool]:
        pack_for_cpu_kernels(weights, torch.device("cpu"), torch.float32, activations)  # type: ignore[arg-type]
        pack_for_cpu_kernels(odd_head, torch.device("cpu"), torch.float32, activations)  # type: ignore[arg-type]
        assert not vars(odd_head.lm_head)["gemv_pack"].int8_activations
        return {vars(w)["gemv_pack"].int8_activations for w in [*vars(layer).values(), weights.lm_head]}

    for has_it in (True, False):
        monkeypatch.setattr(int4_gemv_cpu, "has_int8_dot", lambda has_it=has_it: has_it)
        assert chosen("none") == {False}
        if has_it:
            assert chosen("int8") == {True}
        else:
            with pytest.raises(ValueError, match="AVX-512 VNNI"):
                chosen("int8")
    assert EngineConfig.build(loaded.config).activation_quantization == "none"
    with pytest.raises(ValueError, match="activation_quantization must be one of none, int8"):
        EngineConfig.build(loaded.config, activation_quantization="int4")
