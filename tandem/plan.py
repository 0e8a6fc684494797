"""``tandem plan``: the KV capacity a worker would have, worked out before anything is loaded.

Only the model's config is read (``config.json`` of a Hugging Face directory, or a GGUF
file's metadata through ``gguf.GGUFReader``): no weights, no torch, no transformers. The
fields are read with the defaults transformers applies, so the shape is the one
:class:`tandem.config.ModelConfig` gets when a worker loads the model, and the KV numbers are
those it logs at start (``KV pool: ...``), from the same :class:`~tandem.kvcache.capacity.KVCapacity`.

Per rank, with ``tp`` ranks:

    weights   = parameters (counted from the shapes) × bytes per element / tp  (an even split)
    KV memory = memory − weights
    KV blocks = KV memory // (block_size × bytes_per_token)   (see tandem.kvcache.capacity)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from tandem.kvcache.capacity import DTYPE_BYTES, KVCapacity, gib_to_bytes, kv_heads_per_rank
from tandem.model.source import resolve_model_source

# Architectures tandem serves (tandem.config.SUPPORTED_ARCHITECTURES), by GGUF/HF model type.
ARCHITECTURE_OF_MODEL_TYPE = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                              "mistral": "MistralForCausalLM"}
# transformers' defaults where config.json leaves a field out.
_DEFAULT_MAX_POSITIONS = {"LlamaForCausalLM": 2048, "Qwen2ForCausalLM": 32768, "MistralForCausalLM": 4096 * 32}
_MISTRAL_SLIDING_WINDOW = 4096
_UNSUPPORTED_ROPE_TYPES = ("dynamic", "longrope")


@dataclass(frozen=True)
class ModelShape:
    """What sizes a Llama-family decoder's weights and KV cache (ModelConfig's fields, torch-free)."""

    name: str
    architecture: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    attention_bias: bool
    tie_word_embeddings: bool
    max_position_embeddings: int
    sliding_window: int | None

    @property
    def num_parameters(self) -> int:
        """Parameters of the weights a worker holds: embeddings, q/k/v/o (+ q/k/v biases),
        gate/up/down, two norms per layer, the final norm and an untied lm_head."""
        qkv = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        layer = (qkv * self.hidden_size + (qkv if self.attention_bias else 0)
                 + self.hidden_size * self.num_heads * self.head_dim
                 + 3 * self.intermediate_size * self.hidden_size + 2 * self.hidden_size)
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return embeddings + self.num_layers * layer + self.hidden_size

    def context_limit(self, max_model_len: int | None = None) -> int:
        """The longest sequence before the pool's own cap, as EngineConfig.build works it out:
        max_position_embeddings, at most max_model_len, at most the sliding window."""
        limit = self.max_position_embeddings
        if max_model_len is not None:
            if max_model_len < 1:
                raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
            limit = min(limit, max_model_len)
        if self.sliding_window is not None and self.sliding_window < limit:
            limit = self.sliding_window
        return limit


def _check(architecture: str, where: str) -> None:
    if architecture not in ARCHITECTURE_OF_MODEL_TYPE.values():
        raise ValueError(f"unsupported architecture {architecture!r} in {where}: tandem supports "
                         f"{', '.join(ARCHITECTURE_OF_MODEL_TYPE.values())}")


def read_hf_shape(directory: str, name: str) -> ModelShape:
    """The shape from a Hugging Face directory's config.json (with transformers' defaults)."""
    path = os.path.join(directory, "config.json")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    try:
        return _hf_shape(cfg, path, name)
    except KeyError as e:
        raise ValueError(f"{path} has no {e.args[0]!r}") from None


def _hf_shape(cfg: dict, path: str, name: str) -> ModelShape:
    """read_hf_shape on the parsed config.json (KeyError: a required field is missing)."""
    architecture = (cfg.get("architectures") or [ARCHITECTURE_OF_MODEL_TYPE.get(cfg.get("model_type"), "?")])[0]
    _check(architecture, path)
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if (rope.get("rope_type") or rope.get("type")) in _UNSUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported RoPE type {rope.get('rope_type') or rope.get('type')!r} in {path}")
    num_heads = cfg["num_attention_heads"]
    if architecture == "MistralForCausalLM":
        sliding_window = cfg.get("sliding_window", _MISTRAL_SLIDING_WINDOW)
    elif architecture == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
        sliding_window = None
    else:
        sliding_window = cfg.get("sliding_window")
    return ModelShape(
        name=name, architecture=architecture, num_layers=cfg["num_hidden_layers"],
        hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"], num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads, vocab_size=cfg["vocab_size"],
        attention_bias=architecture == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        max_position_embeddings=cfg.get("max_position_embeddings", _DEFAULT_MAX_POSITIONS[architecture]),
        sliding_window=sliding_window,
    )


def read_gguf_shape(path: str, name: str) -> ModelShape:
    """The shape from a GGUF file's metadata (memory-mapped: no tensor data is read), mapped as
    transformers maps it when it loads the file."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(path)

    def get(key: str, default: object = None) -> object:
        field = reader.fields.get(key)
        if field is None:
            return default
        value = field.parts[field.data[0]]
        return bytes(value).decode() if field.types[0] == GGUFValueType.STRING else value[0].item()

    arch = get("general.architecture")
    # transformers' rule: a llama file whose general.name is "mistral" is a Mistral model.
    model_type = "mistral" if arch == "llama" and get("general.name") == "mistral" else arch
    architecture = ARCHITECTURE_OF_MODEL_TYPE.get(model_type, str(model_type))
    _check(architecture, path)
    hidden, num_heads = get(f"{arch}.embedding_length"), get(f"{arch}.attention.head_count")
    head_dim = get(f"{arch}.rope.dimension_count") if model_type != "qwen2" else None
    vocab_size = get(f"{arch}.vocab_size")
    if vocab_size is None:
        vocab_size = len(reader.fields["tokenizer.ggml.tokens"].data)
    return ModelShape(
        name=name, architecture=architecture, num_layers=get(f"{arch}.block_count"), hidden_size=hidden,
        intermediate_size=get(f"{arch}.feed_forward_length"), num_heads=num_heads,
        num_kv_heads=get(f"{arch}.attention.head_count_kv") or num_heads,
        head_dim=head_dim or hidden // num_heads, vocab_size=vocab_size,
        attention_bias=model_type == "qwen2",
        tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors),
        max_position_embeddings=get(f"{arch}.context_length"),
        sliding_window=_MISTRAL_SLIDING_WINDOW if model_type == "mistral" else None,
    )


def read_model_shape(model: str | None) -> ModelShape:
    """The shape of ``model`` (as ``--model`` takes it; None: the embedded default) from its config alone."""
    source = resolve_model_source(model)  # finds files only: loads nothing
    if source.gguf_file is not None:
        return read_gguf_shape(os.path.join(source.path, source.gguf_file), source.name)
    return read_hf_shape(source.path, source.name)


@dataclass(frozen=True)
class Plan:
    """One rank's memory: weights, then the KV pool in what is left."""

    shape: ModelShape
    dtype: str
    tp: int
    memory_bytes: int
    weight_bytes: int
    weights_estimated: bool
    capacity: KVCapacity

    @property
    def kv_memory_bytes(self) -> int:
        """memory − weights: what the KV pool is sized from (its blocks may leave a remainder)."""
        return self.memory_bytes - self.weight_bytes

    @property
    def kv_cache_memory_gib(self) -> float:
        """The same KV memory as ``--kv-cache-memory-gib`` (exact: a multiple of 2**-30)."""
        return self.kv_memory_bytes / 2**30

    def lines(self) -> list[str]:
        """What ``tandem plan`` prints."""
        s, c = self.shape, self.capacity
        heads = kv_heads_per_rank(s.num_kv_heads, self.tp)
        window = f", sliding window {s.sliding_window}" if s.sliding_window is not None else ""
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
            f"x {s.head_dim} head dim x {DTYPE_BYTES[self.dtype]} bytes",
            f"KV blocks: {c.num_blocks} of {c.block_size} tokens = {_mib(c.pool_bytes)}",
            f"KV tokens: {c.num_tokens}",
            f"max concurrency: {c.max_concurrency:.2f}x at max_model_len {c.max_model_len} "
            f"({c.full_length_text()})",
        ]
        if self.tp == 1:
            lines.append(f"same pool: --kv-cache-memory-gib {self.kv_cache_memory_gib!r}")
        lines.append(f"KV pool: {c.describe()}")
        return lines


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f} MiB ({num_bytes} bytes)"


def make_plan(model: str | None = None, memory_gib: float = 1.0, *, tp: int = 1, dtype: str = "float32",
              block_size: int = 16, max_model_len: int | None = None,
              weights_memory_gib: float | None = None, shape: ModelShape | None = None) -> Plan:
    """Plan one rank of ``tp`` with ``memory_gib`` GiB for weights and KV (``weights_memory_gib``
    None: estimated from the shapes). ValueError when the weights leave no room for a KV block."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")
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
    if memory_bytes - weight_bytes <= 0:
        raise ValueError(
            f"--memory {memory_gib} GiB per rank leaves no room for the KV cache: the weights take "
            f"{_mib(weight_bytes)} per rank ({dtype}, tp {tp}); give more --memory, a larger --tp "
            "or a smaller --dtype"
        )
    try:
        capacity = KVCapacity.from_memory(
            memory_bytes - weight_bytes, block_size=block_size, dtype_bytes=DTYPE_BYTES[dtype],
            num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
            max_model_len=shape.context_limit(max_model_len), tp=tp,
        )
    except ValueError as e:
        raise ValueError(f"--memory {memory_gib} GiB per rank is too small after the weights: {e}") from None
    return Plan(shape, dtype, tp, memory_bytes, weight_bytes, weights_memory_gib is None, capacity)
