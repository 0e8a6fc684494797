"""The sampling defaults a model ships in its generation_config.json, applied as vLLM applies
them (``--generation-config auto``, its default): to each request that leaves the field unset.
Torch-free."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping

logger = logging.getLogger(__name__)

GENERATION_CONFIG_CHOICES_HELP = ("auto (the model's generation_config.json), vllm (none: tandem's own defaults), "
                                  "or a directory holding a generation_config.json")
SAMPLING_KEYS: Mapping[str, str] = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                                    "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
"""generation_config.json key -> the SamplingParams field it gives a default for (vLLM's set)."""


def sampling_defaults(model_dir: str, generation_config: str = "auto") -> dict[str, float | int]:
    """-> SamplingParams field -> default, from `model_dir`'s generation_config.json (auto), none
    (vllm), or the one in the directory `generation_config` names."""
    if generation_config == "vllm":
        return {}
    directory = model_dir if generation_config == "auto" else generation_config
    path = os.path.join(directory, "generation_config.json")
    if not os.path.isfile(path):
        if generation_config != "auto":
            raise FileNotFoundError(f"--generation-config {generation_config}: no generation_config.json there")
        return {}
    with open(path, encoding="utf-8") as f:
        given = json.load(f)
    defaults = {field: given[key] for key, field in SAMPLING_KEYS.items()
                if isinstance(given.get(key), (int, float)) and not isinstance(given.get(key), bool)}
    if defaults:
        logger.info("sampling defaults from %s: %s", path, defaults)
    return defaults
