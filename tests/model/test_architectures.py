"""Every supported architecture loads from a local Hugging Face directory with the weights
transformers' model holds and generates exactly what transformers generates; anything else is
refused with a clear error."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from reference import hf_greedy
from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

from tandem import LLM, SamplingParams
from tandem.model.checkpoint import SafetensorsCheckpoint, load_float_checkpoint
from tandem.model.loader import load_hf_model, load_model, loaded_from_hf_model
from tandem.model.source import resolve_model_source

pytestmark = pytest.mark.slow

SMALL: dict[str, Any] = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    # Wide initial weights spread the logits, so greedy choices are not near-ties.
    initializer_range=0.3, bos_token_id=1, eos_token_id=2,
)
CONFIGS = {
    "llama-untied-bias-theta": lambda: LlamaConfig(**SMALL, tie_word_embeddings=False, attention_bias=True,
                                                   rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "llama-rope-linear-scaling": lambda: LlamaConfig(**SMALL, tie_word_embeddings=True, rope_parameters={
        "rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}),
    "qwen2": lambda: Qwen2Config(**SMALL, tie_word_embeddings=True),
    "mistral-gqa-1": lambda: MistralConfig(**{**SMALL, "num_key_value_heads": 1}, sliding_window=256),
}


def save_random_model(config, directory, tokenizer) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_local_directory_matches_transformers(name, tmp_path, tokenizer):
    config = CONFIGS[name]()
    save_random_model(config, tmp_path, tokenizer)
    hf_model, _ = load_hf_model(resolve_model_source(str(tmp_path)))
    prompts = [list(range(200, 200 + n)) for n in (1, 9, 40, 130)]
    llm = LLM(str(tmp_path), block_size=8, kv_cache_memory_gib=0.05)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    expected = [hf_greedy(hf_model, p, 16, eos_token_ids=(10**6,)) for p in prompts]
    assert [o.token_ids for o in outputs] == expected
    if name.startswith("mistral"):
        assert llm.config.max_model_len == 256  # capped at the sliding window


def test_unsupported_architecture_is_named(tmp_path, tokenizer):
    from transformers import GPT2LMHeadModel

    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM"):
        LLM(str(tmp_path))


def test_missing_model_path_is_explained(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a local Hugging Face directory"):
        LLM(str(tmp_path / "nowhere"))


def assert_same_weights(got, want) -> None:
    """Every tensor of two ModelWeights equal, bit for bit."""
    assert got.rope_attention_scaling == want.rope_attention_scaling
    for name in ("embed_tokens", "lm_head", "norm", "rope_inv_freq"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert len(got.layers) == len(want.layers)
    for i, (a, b) in enumerate(zip(got.layers, want.layers)):
        for field in dataclasses.fields(a):
            x, y = getattr(a, field.name), getattr(b, field.name)
            assert (x is None and y is None) or torch.equal(x, y), (i, field.name)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_weights_read_from_the_files_equal_transformers_model(name, tmp_path, tokenizer):
    """load_model reads safetensors itself (checkpoint.py): the same tensors, RoPE frequencies
    and config as taking them from the model transformers builds from the same files."""
    save_random_model(CONFIGS[name](), tmp_path, tokenizer)
    source = resolve_model_source(str(tmp_path))
    hf_model, hf_tokenizer = load_hf_model(source)
    want = loaded_from_hf_model(hf_model, hf_tokenizer, source.name, torch.float32)
    got = load_float_checkpoint(source, torch.float32)
    assert got.config == want.config
    assert_same_weights(got.weights, want.weights)


def test_the_default_models_converted_copy_reads_as_transformers_model(tokenizer):
    """The default GGUF model's converted copy (what every worker loads), read directly and
    through transformers' model, in float32 and bfloat16."""
    from tandem.model.gguf_cache import cached_source

    source = resolve_model_source(None)
    hf_model, hf_tokenizer = load_hf_model(source)  # converts the GGUF file first when there is no copy yet
    converted = cached_source(source)
    assert converted.gguf_file is None, "load_hf_model keeps the converted copy"
    for dtype in (torch.float32, torch.bfloat16):
        want = loaded_from_hf_model(hf_model, hf_tokenizer, source.name, dtype)
        got = load_model(source, dtype)
        assert got.config == want.config
        assert_same_weights(got.weights, want.weights)


def test_a_directory_without_safetensors_is_refused(tmp_path):
    LlamaConfig(**SMALL).save_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        SafetensorsCheckpoint(str(tmp_path))
