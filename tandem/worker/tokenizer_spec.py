"""The worker's side of the tokenizer handshake: a transformers fast tokenizer described as a
TokenizerSpec, which the router rebuilds with the torch-free ``tokenizers`` library."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tandem.worker.api import TokenizerSpec


def tokenizer_spec_from(tokenizer: Any, model_name: str, vocab_size: int, max_model_len: int,
                        sampling_defaults: Mapping[str, float | int] | None = None,
                        scheduling_policy: str = "fcfs") -> TokenizerSpec:
    """Describe a transformers fast tokenizer for the router (reads attributes only: no heavy imports)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(f"{type(tokenizer).__name__} is not a fast tokenizer: the router needs its tokenizer.json")
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates (e.g. "default", "tool_use"): chat uses the default
        template = template.get("default")
    return TokenizerSpec(
        tokenizer_json=backend.to_str(),
        chat_template=template if isinstance(template, str) else None,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
        add_bos_token=bool(getattr(tokenizer, "add_bos_token", False)),
        model_name=model_name,
        vocab_size=vocab_size,
        max_model_len=max_model_len,
        sampling_defaults=tuple(sorted((sampling_defaults or {}).items())),
        scheduling_policy=scheduling_policy,
    )
