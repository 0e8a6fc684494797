"""What both loaders share: transformers' (loader.py) and the GPTQ/AWQ reader (gptq_awq.py).

The checkpoint's config, refused early; its stop tokens; and the LoadedModel both return.
Here, beneath both, so that loader.py (which dispatches to gptq_awq.py) and gptq_awq.py
import this instead of each other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.config import ARCHITECTURE_OF_MODEL_TYPE, ModelConfig, check_architecture
from tandem.model.llama import ModelWeights
from tandem.model.source import ModelSource

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class LoadedModel:
    """Our model's config and weights, with the tokenizer from the same files."""

    config: ModelConfig
    weights: ModelWeights
    tokenizer: PreTrainedTokenizerBase | None
    """None: token ids in and out only (tests of the engine alone)."""


def load_hf_config(source: ModelSource):  # -> transformers.PretrainedConfig
    """The checkpoint's config, refused early (before any weight is read) when unsupported
    (a GGUF file's from its converted copy once there is one, as load_tokenizer)."""
    from transformers import AutoConfig

    from tandem.model.gguf_cache import cached_source

    source = cached_source(source)
    hf_config = AutoConfig.from_pretrained(source.path, **source.from_pretrained_kwargs())
    if not hf_config.architectures:  # GGUF files carry a model type but no architecture list
        guess = ARCHITECTURE_OF_MODEL_TYPE.get(hf_config.model_type, hf_config.model_type)
        hf_config.architectures = [guess]
    check_architecture(hf_config.architectures[0], source.path)
    return hf_config


def eos_token_ids_of(hf_model, tokenizer) -> tuple[int, ...]:
    """Every id that ends a sequence: the model's generation config's and the tokenizer's."""
    ids: set[int] = set()
    gen_eos = getattr(getattr(hf_model, "generation_config", None), "eos_token_id", None)
    for value in (gen_eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value is not None:
            ids.update(value)
    return tuple(sorted(ids))
