"""Weight-only int8: the quantization's error bound, the int8 product against a float64
reference, exact weight bytes, and on the default model how close int8 stays to float32."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from reference import english_token_ids

from tandem import SamplingParams
from tandem.bench.quant import forced_agreement, perplexity
from tandem.config import EngineConfig
from tandem.model.quantization import Int8Weight, linear, quantize_int8, quantize_weights

BF16_EPS = 2.0 ** -8  # unit roundoff of bfloat16 (8 significant bits)


def random_weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """Rows of very different magnitudes (as real projections have), one of them all zero."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) * torch.logspace(-3, 0, out_features)[:, None]
    w[3] = 0.0
    return w


def test_quantize_int8_error_bound_per_channel():
    w = random_weight(96, 200)
    q = quantize_int8(w)
    assert q.qweight.dtype == torch.int8 and q.qweight.shape == (96, 200) and q.scale.shape == (96,)
    w64 = w.double()
    scale64 = w64.abs().amax(dim=1) / 127  # the definition, in float64
    torch.testing.assert_close(q.scale.double(), scale64, rtol=1e-6, atol=0)
    error = (w64 - q.qweight.double() * q.scale.double()[:, None]).abs()
    # Round to nearest: at most half a step of the row's own scale (+ float32 rounding of w / scale).
    assert bool((error <= q.scale.double()[:, None] * (0.5 + 1e-5)).all())
    assert int(q.qweight.abs().max()) == 127 and int(q.qweight.min()) >= -127
    nonzero = [i for i in range(96) if i != 3]
    assert bool((q.qweight[nonzero].abs().amax(dim=1) == 127).all())  # each row's max reaches the grid's end
    assert float(q.scale[3]) == 0.0 and bool((q.qweight[3] == 0).all())  # a zero row stays exactly zero
    torch.testing.assert_close(q.dequantize().double(), w64, atol=float(q.scale.max()) / 2 * 1.0001, rtol=0)


def test_linear_float_weight_is_exactly_f_linear():
    w, x, b = random_weight(40, 24), torch.randn(7, 24), torch.randn(40)
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(linear(x.bfloat16(), w.bfloat16()), F.linear(x.bfloat16(), w.bfloat16()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 8, 24, 25, 64, 300])  # the int8 kernel up to 24 rows, then dequantized
def test_linear_int8_within_quantization_error_of_float64(num_tokens, dtype):
    w, b = random_weight(160, 576, seed=num_tokens), torch.randn(160) * 0.1
    q = quantize_int8(w)
    x = torch.randn(num_tokens, 576, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = linear(x, q, b.to(dtype))
    assert out.dtype == dtype and out.shape == (num_tokens, 160)
    x64, w_hat = x.double(), q.dequantize(torch.float64)
    expected = x64 @ w.double().T + b.to(dtype).double()  # the float weight, in float64
    # |x| . |w - w_hat| <= sum_k |x_k| * scale / 2: the quantization's own error; then the
    # product runs in bf16: x rounded (eps |x|.|w_hat|), the product rounded (eps |x w_hat|),
    # and for a bf16 result once more.
    magnitude = x64.abs() @ w_hat.abs().T
    bound = (x64.abs().sum(-1, keepdim=True) * q.scale.double() / 2
             + (2 if dtype == torch.float32 else 3) * BF16_EPS * (magnitude + b.abs().double()) + 1e-6)
    error = (out.double() - expected).abs()
    assert bool((error <= bound).all()), float((error / bound).max())
    # The two int8 ways (kernel, dequantized weight) compute the same product.
    from tandem.model.quantization import int8_matmul

    x2 = x.reshape(-1, 576)
    torch.testing.assert_close(int8_matmul(x2, q, use_kernel=True), int8_matmul(x2, q, use_kernel=False),
                               rtol=2 * BF16_EPS, atol=1e-3)


def test_linear_int8_keeps_leading_dimensions():
    q = quantize_int8(random_weight(32, 16))
    assert linear(torch.randn(2, 3, 16), q).shape == (2, 3, 32)
    assert linear(torch.randn(0, 16), q).shape == (0, 32)


def test_engine_config_quantization_is_validated(loaded):
    assert EngineConfig.build(loaded.config).quantization is None
    config = EngineConfig.build(loaded.config, quantization="int8")
    assert config.quantization == "int8"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.quantization = None  # type: ignore[misc]
    assert EngineConfig.build(loaded.config, quantization="int4").quantization == "int4"
    for bad in ("int2", "INT8", ""):
        with pytest.raises(ValueError, match="quantization must be None or one of auto, none, int8, int4"):
            EngineConfig.build(loaded.config, quantization=bad)


def test_weight_bytes_exact(loaded):
    """int8 + float32 scales for the four projections of every layer and the LM head; the
    rest as it was. The shared float weights are left untouched."""
    cfg, float_weights = loaded.config, loaded.weights
    weights = quantize_weights(float_weights, "int8")
    h, i = cfg.hidden_size, cfg.intermediate_size
    qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    projections = [(qkv_out, h), (h, cfg.num_heads * cfg.head_dim), (2 * i, h), (h, i)]
    int8_bytes = lambda o, n: o * n + 4 * o  # noqa: E731
    layer_float = 2 * h * 4 + (qkv_out * 4 if cfg.attention_bias else 0)  # norms (and q/k/v biases), float32
    expected = (cfg.num_layers * (sum(int8_bytes(o, n) for o, n in projections) + layer_float)
                + int8_bytes(cfg.vocab_size, h) + h * 4)
    assert weights.num_bytes == expected
    float_projections = 4 * (cfg.num_layers * sum(o * n for o, n in projections) + cfg.vocab_size * h)
    assert float_weights.num_bytes == float_projections + cfg.num_layers * layer_float + h * 4
    ratio = (expected - cfg.num_layers * layer_float - h * 4) / float_projections
    print(f"\nweight bytes read per decode step: float32 {float_weights.num_bytes / 1e6:.1f} MB, "
          f"int8 {weights.num_bytes / 1e6:.1f} MB ({weights.num_bytes / float_weights.num_bytes:.3f}x); "
          f"projections {ratio:.4f}x (1/4 + scales)")
    assert 0.25 < ratio < 0.2521  # 1/4, plus 4 bytes of scale per row of >= 576 int8 bytes
    assert all(isinstance(w, torch.Tensor) for layer in float_weights.layers for w in vars(layer).values()
               if w is not None)
    assert isinstance(float_weights.lm_head, torch.Tensor)
    assert quantize_weights(weights, "int8") is weights  # quantized already: kept as it is
    assert quantize_weights(float_weights, None) is float_weights


@pytest.mark.slow
def test_greedy_agreement_with_float32(make_llm, loaded, tokenizer):
    """Four English prompts x 32 greedy tokens. forced: the share of float32's tokens int8
    picks given float32's prefix (each choice judged on its own); same: free-running, where
    the first near-tie changes everything after it.

    Measured on this machine: forced 97.7% (bfloat16 weights: 97.7%; int8 on a bfloat16
    model: 95.3%), same 59% (bfloat16: 98%). The threshold 0.85 leaves room for another CPU's
    rounding, and is far above what a broken product gives (scales of the wrong rows: 0%;
    scales 1.5x too large: 7%)."""
    prompts = [english_token_ids(tokenizer, 48, skip=300 * k) for k in range(4)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    reference = [o.token_ids for o in make_llm().generate(prompts, params)]
    llm = make_llm(quantization="int8")
    assert isinstance(llm.engine.runner.model.weights.layers[0].qkv_proj, Int8Weight)
    outputs = [o.token_ids for o in llm.generate(prompts, params)]
    same = sum(a == b for out, ref in zip(outputs, reference) for a, b in zip(out, ref)) / (32 * len(prompts))
    forced = forced_agreement(loaded, "float32", prompts, reference, quantization="int8")
    print(f"\nint8 vs float32 greedy, {len(prompts)} prompts x 32 tokens: forced agreement {forced:.1%}, "
          f"same tokens free-running {same:.1%}")
    assert forced >= 0.85
    assert forced_agreement(loaded, "float32", prompts, reference) >= 0.97  # float32 against itself


@pytest.mark.slow
def test_perplexity_close_to_float32(loaded, tokenizer):
    """1024 tokens of English text in one prefill. Measured: float32 11.494, int8 11.584
    (+0.78%; bfloat16 weights: +0.12%); the bound 3% is far below what a broken product
    gives (scales 1.5x too large: perplexity above 300000)."""
    text = english_token_ids(tokenizer, 1024)
    base = perplexity(loaded, "float32", text)
    quant = perplexity(loaded, "float32", text, quantization="int8")
    print(f"\nperplexity over {len(text)} tokens: float32 {base:.3f}, int8 {quant:.3f} ({quant / base - 1:+.2%})")
    assert abs(quant / base - 1) < 0.03
