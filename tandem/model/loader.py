"""Load a model into tandem's layout: safetensors directories (a GGUF file's converted copy
included) straight from their files, anything else through transformers' model."""

from __future__ import annotations

import logging
import time

import torch
from tqdm.auto import tqdm

from tandem.config import EngineConfig, ModelConfig
from tandem.model.checkpoint import SafetensorsCheckpoint, load_float_checkpoint
from tandem.model.gguf_cache import cached_source, save_converted
from tandem.model.gguf_q4 import gguf_path, keep_gguf_int4
from tandem.model.gptq_awq import is_quantized_checkpoint, load_quantized_checkpoint
from tandem.model.llama import LayerWeights, ModelWeights
from tandem.model.loaded import LoadedModel, eos_token_ids_of, load_hf_config
from tandem.model.placement import weights_on
from tandem.model.quantization import quantize_weights
from tandem.model.source import ModelSource, load_tokenizer

logger = logging.getLogger(__name__)


def load_hf_model(source: ModelSource):
    """-> (transformers model in float32, tokenizer), refusing unsupported architectures first."""
    from transformers import AutoModelForCausalLM

    original, source = source, cached_source(source)
    if is_quantized_checkpoint(source):
        raise ValueError(f"{source.path} is a quantized checkpoint: transformers needs optimum/gptqmodel/autoawq to "
                         "load it; tandem's load_model reads GPTQ and AWQ directories itself")
    hf_config = load_hf_config(source)
    logger.info("loading %s (%s) from %s", source.name, hf_config.architectures[0], source.path)
    tokenizer = load_tokenizer(source)
    hf_model = AutoModelForCausalLM.from_pretrained(
        source.path, config=hf_config, dtype=torch.float32, **source.from_pretrained_kwargs()
    )
    if source is original:
        save_converted(source, hf_model, tokenizer)
    return hf_model.eval(), tokenizer


def loaded_from_hf_model(hf_model, tokenizer, name: str, dtype: torch.dtype) -> LoadedModel:
    """Take a transformers model's weights into our layout (the model itself stays usable)."""
    config = ModelConfig.from_hf_config(hf_model.config, name, eos_token_ids_of(hf_model, tokenizer))
    return LoadedModel(config, weights_from_hf_model(hf_model, config, dtype), tokenizer)


def load_model(source: ModelSource, dtype: torch.dtype) -> LoadedModel:
    """Load ``source`` for serving, showing progress."""
    start = time.perf_counter()
    converted = cached_source(source)  # a GGUF file's converted copy, once there is one
    if is_quantized_checkpoint(source):  # GPTQ / AWQ: projections stay int4 (see gptq_awq.py)
        loaded = load_quantized_checkpoint(source, dtype)
    elif converted.gguf_file is None and SafetensorsCheckpoint.exists_in(converted.path):
        loaded = load_float_checkpoint(converted, dtype)
    else:
        hf_model, tokenizer = load_hf_model(source)
        loaded = loaded_from_hf_model(hf_model, tokenizer, source.name, dtype)
    logger.info("loaded %s in %.1f s (%.0f MB of weights)", source.name,
                time.perf_counter() - start, loaded.weights.num_bytes / 1e6)
    return loaded


def quantized(loaded: LoadedModel, quantization: str | None, source: ModelSource | None = None) -> LoadedModel:
    """``loaded`` with its projections quantized (see quantization.quantize_weights), as a
    new LoadedModel: the float weights stay as they are for whoever else shares them.

    source: the files ``loaded`` came from. For "int4" from a GGUF file, the file's own Q4_1
    blocks are kept bit-exactly (gguf_q4.py) instead of quantizing their float32 copy again.
    """
    if quantization is None:
        return loaded
    start = time.perf_counter()
    path = gguf_path(source) if quantization == "int4" else None
    if path is not None:
        weights = keep_gguf_int4(loaded.weights, loaded.config, path)
    else:
        weights = quantize_weights(loaded.weights, quantization)
    if weights is loaded.weights:  # quantized already
        return loaded
    logger.info("quantized %s to %s in %.1f s (%.0f MB of weights, from %.0f MB)", loaded.config.name, quantization,
                time.perf_counter() - start, weights.num_bytes / 1e6, loaded.weights.num_bytes / 1e6)
    return LoadedModel(loaded.config, weights, loaded.tokenizer)


def on_device(loaded: LoadedModel, config: EngineConfig) -> LoadedModel:
    """``loaded`` with its weights in ``config``'s dtype on its device (itself where they are
    so already: a CPU engine shares the weights it was given)."""
    weights = weights_on(loaded.weights, config.device)
    if weights.embed_tokens.dtype != config.dtype:
        raise ValueError(f"the weights were loaded in {weights.embed_tokens.dtype}, the engine runs "
                         f"{config.dtype_name}: load them in the engine's dtype")
    if weights is loaded.weights:
        return loaded
    logger.info("weights on %s (%.0f MB)", config.device, weights.num_bytes / 1e6)
    return LoadedModel(loaded.config, weights, loaded.tokenizer)


def weights_from_hf_model(hf_model, config: ModelConfig, dtype: torch.dtype) -> ModelWeights:
    """Copy (and fuse) a transformers Llama-family model's weights into ``ModelWeights``."""
    state = hf_model.state_dict()

    def get(name: str) -> torch.Tensor:
        return state[name].detach().to(dtype).contiguous()

    layers = []
    for i in tqdm(range(config.num_layers), desc="Taking weights into tandem's layout", unit="layer"):
        p = f"model.layers.{i}."
        qkv_bias = None
        if config.attention_bias:
            qkv_bias = torch.cat([get(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
        layers.append(LayerWeights(
            qkv_proj=torch.cat([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"]),
            qkv_bias=qkv_bias,
            o_proj=get(p + "self_attn.o_proj.weight"),
            gate_up_proj=torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")]),
            down_proj=get(p + "mlp.down_proj.weight"),
            input_norm=get(p + "input_layernorm.weight"),
            post_attention_norm=get(p + "post_attention_layernorm.weight"),
        ))
    embed = get("model.embed_tokens.weight")
    lm_head = embed if config.tie_word_embeddings else get("lm_head.weight")
    rotary = hf_model.model.rotary_emb
    return ModelWeights(
        embed_tokens=embed,
        layers=layers,
        norm=get("model.norm.weight"),
        lm_head=lm_head,
        rope_inv_freq=rotary.inv_freq.detach().float().clone(),
        rope_attention_scaling=float(rotary.attention_scaling),
    )
