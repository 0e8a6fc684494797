"""A Hugging Face safetensors directory read straight into tandem's layout, without building
transformers' model: the float loader of every converted GGUF copy and plain checkpoint, and
the frame the GPTQ/AWQ reader (gptq_awq.py) fills with its int4 projections.

Building the transformers model first (what loader.load_hf_model does) imports its modeling
chain and allocates a second copy of every weight: about 2 s of each worker's start for the
default model. transformers still supplies the config, the generation config, the tokenizer
and the RoPE rules; tests/model/test_checkpoint.py checks the weights equal transformers' own.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch

from tandem.config import ModelConfig
from tandem.model.int4 import Int4Weight
from tandem.model.llama import LayerWeights, ModelWeights
from tandem.model.loaded import LoadedModel, eos_token_ids_of, load_hf_config
from tandem.model.quantization import Weight
from tandem.model.source import ModelSource, load_tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

EMBED = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"


class SafetensorsCheckpoint:
    """The tensors of model.safetensors, or of the shards a model.safetensors.index.json names."""

    def __init__(self, directory: str) -> None:
        from safetensors import safe_open

        index = os.path.join(directory, "model.safetensors.index.json")
        weight_map: dict[str, str] | None
        if os.path.isfile(index):
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        elif os.path.isfile(os.path.join(directory, "model.safetensors")):
            weight_map = None  # filled below from the one file
        else:
            # NOTE: no pickle fallback (pytorch_model.bin): tandem never unpickles weights.
            raise FileNotFoundError(f"{directory} has no model.safetensors or model.safetensors.index.json")
        files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
        self._handles = {name: safe_open(os.path.join(directory, name), framework="pt") for name in files}
        if weight_map is None:
            weight_map = {key: files[0] for key in self._handles[files[0]].keys()}
        self.weight_map = weight_map
        self.directory = directory

    @staticmethod
    def exists_in(directory: str) -> bool:
        return any(os.path.isfile(os.path.join(directory, name))
                   for name in ("model.safetensors", "model.safetensors.index.json"))

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def where(self, name: str) -> str:
        """'file: tensor', for error messages."""
        return f"{os.path.join(self.directory, self.weight_map.get(name, '?'))}: {name}"

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise KeyError(f"{self.directory}: the checkpoint has no tensor {name!r}")
        return self._handles[self.weight_map[name]].get_tensor(name)


def rotary_of(hf_config) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim / 2] float32, attention scaling) by transformers' RoPE rules: the
    default type as every Llama-family rotary class computes it, the others by
    ROPE_INIT_FUNCTIONS (what the model's ``rotary_emb`` would hold)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = hf_config.rope_parameters
    if rope["rope_type"] != "default":
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config)
        return inv_freq.float(), float(scaling)
    dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return 1.0 / (rope["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0


def cat_rows(parts: list[Weight], where: str) -> Weight:
    """Fuse projections along the output: all float tensors, or Int4Weights of one group size."""
    floats = [p for p in parts if isinstance(p, torch.Tensor)]
    if len(floats) == len(parts):
        return torch.cat(floats)
    int4 = [p for p in parts if isinstance(p, Int4Weight)]
    if len(int4) != len(parts) or len({p.group_size for p in int4}) != 1:
        raise ValueError(f"{where}: the projections fused here mix quantized and float (or group sizes)")
    return Int4Weight(torch.cat([p.qweight for p in int4]), torch.cat([p.scale for p in int4]),
                      torch.cat([p.offset for p in int4]), int4[0].group_size)


def weights_from_checkpoint(ckpt: SafetensorsCheckpoint, config: ModelConfig, hf_config, dtype: torch.dtype,
                            projection: Callable[[str], Weight] | None = None) -> ModelWeights:
    """ModelWeights from ``ckpt``: every tensor in ``dtype``, except what ``projection`` reads
    (a module name such as "model.layers.0.mlp.down_proj" -> its weight; default: the float one)."""

    def floating(name: str) -> torch.Tensor:
        return ckpt.get(name).to(dtype).contiguous()

    read = projection or (lambda module: floating(module + ".weight"))
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        qkv_bias = None
        if config.attention_bias:
            qkv_bias = torch.cat([floating(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
        layers.append(LayerWeights(
            qkv_proj=cat_rows([read(p + f"self_attn.{n}_proj") for n in "qkv"], ckpt.where(p + "self_attn")),
            qkv_bias=qkv_bias,
            o_proj=read(p + "self_attn.o_proj"),
            gate_up_proj=cat_rows([read(p + f"mlp.{n}_proj") for n in ("gate", "up")], ckpt.where(p + "mlp")),
            down_proj=read(p + "mlp.down_proj"),
            input_norm=floating(p + "input_layernorm.weight"),
            post_attention_norm=floating(p + "post_attention_layernorm.weight"),
        ))
    # Tied embeddings are stored once, under either name (safetensors keeps one of shared tensors).
    embed = floating(EMBED if EMBED in ckpt or not config.tie_word_embeddings else LM_HEAD)
    lm_head = embed if config.tie_word_embeddings else read("lm_head")
    inv_freq, attention_scaling = rotary_of(hf_config)
    return ModelWeights(embed_tokens=embed, layers=layers, norm=floating("model.norm.weight"), lm_head=lm_head,
                        rope_inv_freq=inv_freq, rope_attention_scaling=attention_scaling)


def checkpoint_config(source: ModelSource, hf_config) -> tuple[ModelConfig, PreTrainedTokenizerBase]:
    """(ModelConfig, tokenizer) of a checkpoint directory, its stop tokens from the generation
    config transformers would give its model."""
    from transformers import GenerationConfig

    try:
        generation_config = GenerationConfig.from_pretrained(source.path)
    except OSError:  # no generation_config.json: transformers derives one from the model config
        generation_config = GenerationConfig.from_model_config(hf_config)
    tokenizer = load_tokenizer(source)
    # eos_token_ids_of reads a model's generation_config: give it the one transformers would have.
    eos_ids = eos_token_ids_of(SimpleNamespace(generation_config=generation_config), tokenizer)
    return ModelConfig.from_hf_config(hf_config, source.name, eos_ids), tokenizer


def load_float_checkpoint(source: ModelSource, dtype: torch.dtype) -> LoadedModel:
    """A (non-quantized) safetensors directory, every weight in ``dtype``."""
    hf_config = load_hf_config(source)
    logger.info("loading %s (%s) from %s", source.name, hf_config.architectures[0], source.path)
    config, tokenizer = checkpoint_config(source, hf_config)
    weights = weights_from_checkpoint(SafetensorsCheckpoint(source.path), config, hf_config, dtype)
    return LoadedModel(config, weights, tokenizer)
