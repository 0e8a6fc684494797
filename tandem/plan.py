"""``tandem plan``: the KV capacity a worker would have, worked out before anything is loaded.

Only the model's config is read (``config.json`` of a Hugging Face directory, or a GGUF
file's metadata through ``gguf.GGUFReader``): no weights, no torch, no transformers. Either
goes through :meth:`tandem.config.ModelConfig.from_config_dict`, the parser a worker's
transformers config goes through too, so the shape is the one a worker gets when it loads the
model, and the KV numbers are those it logs at start (``KV pool: ...``), from the same
:class:`~tandem.kvcache.capacity.KVCapacity`.

Per rank, with ``tp`` ranks:

    weights   = parameters (counted from the shapes) × bytes per element / tp  (an even split)
    KV memory = memory − weights
    KV blocks = KV memory // (block_size × bytes_per_token)   (see tandem.kvcache.capacity)

where bytes_per_token counts the KV cache's dtype (``--kv-cache-dtype``; auto: ``--dtype``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from tandem.config import ARCHITECTURE_OF_MODEL_TYPE, ModelConfig, gib_to_bytes, kv_heads_per_rank
from tandem.config.engine_options import ENGINE_DEFAULTS
from tandem.config.names import AUTO, DTYPE_BYTES, auto_dtype_name, resolve_kv_cache_dtype
from tandem.kvcache.capacity import KVCapacity
from tandem.kvcache.memory_plan import DeviceMemoryPlan, estimated_step_peak_bytes
from tandem.model.source import resolve_model_source


def read_hf_shape(directory: str, name: str) -> ModelConfig:
    """The shape from a Hugging Face directory's config.json (with transformers' defaults)."""
    path = os.path.join(directory, "config.json")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    try:
        return ModelConfig.from_config_dict(cfg, name, where=path)
    except KeyError as e:
        raise ValueError(f"{path} has no {e.args[0]!r}") from None


def read_gguf_shape(path: str, name: str) -> ModelConfig:
    """The shape from a GGUF file's metadata (memory-mapped: no tensor data is read), mapped to
    config.json's fields as transformers maps them when it loads the file."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(path)

    def get(key: str, default: object = None) -> Any:
        field = reader.fields.get(key)
        if field is None:
            return default
        value = field.parts[field.data[0]]
        return bytes(value).decode() if field.types[0] == GGUFValueType.STRING else value[0].item()

    arch = get("general.architecture")
    # transformers' rule: a llama file whose general.name is "mistral" is a Mistral model.
    model_type = "mistral" if arch == "llama" and get("general.name") == "mistral" else arch
    cfg = {
        "architectures": [ARCHITECTURE_OF_MODEL_TYPE.get(model_type, str(model_type))],
        "model_type": model_type,
        "num_hidden_layers": get(f"{arch}.block_count"),
        "hidden_size": get(f"{arch}.embedding_length"),
        "intermediate_size": get(f"{arch}.feed_forward_length"),
        "num_attention_heads": get(f"{arch}.attention.head_count"),
        "num_key_value_heads": get(f"{arch}.attention.head_count_kv"),
        # Qwen2's head_dim is always hidden / heads; the others' is the RoPE dimension.
        "head_dim": get(f"{arch}.rope.dimension_count") if model_type != "qwen2" else None,
        "vocab_size": get(f"{arch}.vocab_size"),
        "tie_word_embeddings": all(t.name != "output.weight" for t in reader.tensors),
        "max_position_embeddings": get(f"{arch}.context_length"),
        "rms_norm_eps": get(f"{arch}.attention.layer_norm_rms_epsilon"),
    }
    if cfg["vocab_size"] is None and "tokenizer.ggml.tokens" in reader.fields:
        cfg["vocab_size"] = len(reader.fields["tokenizer.ggml.tokens"].data)
    try:  # a field the file leaves out takes transformers' default, as in config.json
        return ModelConfig.from_config_dict({k: v for k, v in cfg.items() if v is not None}, name, where=path)
    except KeyError as e:
        raise ValueError(f"{path} has no metadata for {e.args[0]!r}") from None


def read_model_shape(model: str | None) -> ModelConfig:
    """The shape of ``model`` (as ``--model`` takes it; None: the embedded default) from its config alone.

    Its eos_token_ids are left empty: a plan needs none, and they come from the tokenizer."""
    source = resolve_model_source(model)  # finds files only: loads nothing
    if source.gguf_file is not None:
        return read_gguf_shape(os.path.join(source.path, source.gguf_file), source.name)
    return read_hf_shape(source.path, source.name)


@dataclass(frozen=True)
class Plan:
    """One rank's memory: weights, then the KV pool in what is left."""

    shape: ModelConfig
    dtype: str
    """The weights' (and activations') dtype."""
    kv_cache_dtype: str
    """The KV cache's dtype (resolved: never auto)."""
    tp: int
    memory_bytes: int
    weight_bytes: int
    weights_estimated: bool
    capacity: KVCapacity
    device_plan: DeviceMemoryPlan | None = None
    """With --gpu-memory-utilization: the device's share (memory_bytes is then its budget)."""

    @property
    def kv_memory_bytes(self) -> int:
        """memory − weights (− a step's peak, on a GPU share): what the KV pool is sized from
        (its blocks may leave a remainder)."""
        peak = 0 if self.device_plan is None else self.device_plan.step_peak_bytes
        return self.memory_bytes - self.weight_bytes - peak

    @property
    def kv_cache_memory_gib(self) -> float:
        """The same KV memory as ``--kv-cache-memory-gib`` (exact: a multiple of 2**-30)."""
        return self.kv_memory_bytes / 2**30

    def lines(self) -> list[str]:
        """What ``tandem plan`` prints."""
        s, c = self.shape, self.capacity
        heads = kv_heads_per_rank(s.num_kv_heads, self.tp)
        window = f", sliding window {s.sliding_window}" if s.sliding_window is not None else ""
        kv_dtype = "" if self.kv_cache_dtype == self.dtype else f" (a {self.kv_cache_dtype} KV cache)"
        lines = [
            f"model: {s.name} ({s.architecture})",
            f"shape: {s.num_layers} layers, hidden {s.hidden_size}, {s.num_heads} heads, {s.num_kv_heads} KV heads "
            f"x head dim {s.head_dim}, intermediate {s.intermediate_size}, vocab {s.vocab_size}, "
            f"context {s.max_position_embeddings}{window}",
            f"parameters: {s.num_parameters} ({s.num_parameters / 1e6:.1f}M), {self.dtype}, tp {self.tp}",
            f"memory per rank: {_mib(self.memory_bytes)}",
            f"weights per rank: {_mib(self.weight_bytes)}, "
            f"{'estimated: parameters x dtype bytes / tp' if self.weights_estimated else 'as given'}",
            f"KV memory per rank: {_mib(self.kv_memory_bytes)} = memory - weights",
            f"KV bytes per token: {c.bytes_per_token} = 2 x {s.num_layers} layers x {heads} KV heads "
            f"x {s.head_dim} head dim x {DTYPE_BYTES[self.kv_cache_dtype]} bytes{kv_dtype}",
            f"KV blocks: {c.num_blocks} of {c.block_size} tokens = {_mib(c.pool_bytes)}",
            f"KV tokens: {c.num_tokens}",
            f"max concurrency: {c.max_concurrency:.2f}x at max_model_len {c.max_model_len} "
            f"({c.full_length_text()})",
        ]
        if self.device_plan is not None:
            lines += self.device_plan.lines()
        if self.tp == 1:
            same_dtype = "" if self.kv_cache_dtype == self.dtype else f" --kv-cache-dtype {self.kv_cache_dtype}"
            lines.append(f"same pool: --kv-cache-memory-gib {self.kv_cache_memory_gib!r}{same_dtype}")
        lines.append(f"KV pool: {c.describe()}")
        return lines


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f} MiB ({num_bytes} bytes)"


def make_plan(model: str | None = None, memory_gib: float = 1.0, *, tp: int = 1,
              dtype: str = ENGINE_DEFAULTS["dtype"], block_size: int = ENGINE_DEFAULTS["block_size"],
              max_model_len: int | None = None, weights_memory_gib: float | None = None,
              shape: ModelConfig | None = None, device: str = ENGINE_DEFAULTS["device"],
              gpu_memory_utilization: float | None = None,
              max_num_batched_tokens: int = ENGINE_DEFAULTS["max_num_batched_tokens"],
              max_num_seqs: int = ENGINE_DEFAULTS["max_num_seqs"],
              kv_cache_dtype: str = ENGINE_DEFAULTS["kv_cache_dtype"]) -> Plan:
    """Plan one rank of ``tp`` with ``memory_gib`` GiB for weights and KV (``weights_memory_gib``
    None: estimated from the shapes). ValueError when the weights leave no room for a KV block.

    With ``gpu_memory_utilization``, ``memory_gib`` is the GPU's memory and the rank takes that
    fraction of it, less an estimate of one full-budget step's peak (a worker measures it:
    kvcache/memory_plan.py). dtype auto: as on ``device`` (auto: a GPU with a utilization, else
    the CPU). kv_cache_dtype auto: as an engine of unquantized weights picks it."""
    if device == "auto":
        device = "cpu" if gpu_memory_utilization is None else "cuda"
    dtype = auto_dtype_name(device) if dtype == AUTO else dtype
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
    kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, dtype, None)
    if tp < 1:
        raise ValueError(f"--tp must be >= 1, got {tp}")
    if memory_gib <= 0:
        raise ValueError(f"--memory must be > 0, got {memory_gib}")
    shape = shape if shape is not None else read_model_shape(model)
    memory_bytes = gib_to_bytes(memory_gib)
    if weights_memory_gib is None:
        weight_bytes = -(-shape.num_parameters * DTYPE_BYTES[dtype] // tp)
    else:
        weight_bytes = gib_to_bytes(weights_memory_gib)
    device_plan = None
    if gpu_memory_utilization is not None:
        num_tokens = min(max_num_batched_tokens, shape.context_limit(max_model_len))
        peak = estimated_step_peak_bytes(shape, num_tokens, max_num_seqs, DTYPE_BYTES[dtype], tp)
        device_plan = DeviceMemoryPlan(memory_bytes, gpu_memory_utilization, weight_bytes, peak,
                                       block_size * shape.kv_bytes_per_token(kv_cache_dtype, tp), measured=False)
        device_plan.num_blocks  # noqa: B018 (refuses a share with no room for a block, saying why)
        memory_bytes = device_plan.budget_bytes
    kv_memory_bytes = memory_bytes - weight_bytes - (0 if device_plan is None else device_plan.step_peak_bytes)
    if kv_memory_bytes <= 0:
        raise ValueError(
            f"--memory {memory_gib} GiB per rank leaves no room for the KV cache: the weights take "
            f"{_mib(weight_bytes)} per rank ({dtype}, tp {tp}); give more --memory, a larger --tp "
            "or a smaller --dtype"
        )
    try:
        capacity = KVCapacity.from_memory(
            kv_memory_bytes, block_size=block_size, dtype_bytes=DTYPE_BYTES[kv_cache_dtype],
            num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
            max_model_len=shape.context_limit(max_model_len), tp=tp,
        )
    except ValueError as e:
        raise ValueError(f"--memory {memory_gib} GiB per rank is too small after the weights: {e}") from None
    return Plan(shape, dtype, kv_cache_dtype, tp, memory_bytes, weight_bytes, weights_memory_gib is None, capacity,
                device_plan)
