"""Every supported architecture loads from a local Hugging Face directory and generates
exactly what transformers generates; anything else is refused with a clear error."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from reference import hf_greedy
from transformers import GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

from tandem import LLM, SamplingParams
from tandem.model.loader import load_hf_model
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
