"""One load shared by every part of ``tandem bench gpu``: transformers' model in float32 (the
parity reference) and tandem's weights taken from it, in float32 and in the timed dtype."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tandem.config import ModelConfig
from tandem.config.device import resolve_device, resolve_dtype
from tandem.model.dtypes import torch_dtype
from tandem.model.loader import LoadedModel, load_hf_model, loaded_from_hf_model
from tandem.model.source import resolve_model_source


@dataclass
class GpuSetup:
    """The model, loaded once on the host; each part moves what it needs to ``device``."""

    name: str
    device: torch.device
    dtype_name: str
    """The timed engine's dtype (resolved: bfloat16, float16 or float32)."""
    hf_model: Any
    """transformers' model in float32 (on the device while parity runs)."""
    tokenizer: Any
    loaded32: LoadedModel
    """tandem's weights in float32 on the host: the parity engine's."""
    loaded: LoadedModel
    """tandem's weights in the timed dtype on the host."""

    @property
    def config(self) -> ModelConfig:
        return self.loaded.config

    @property
    def dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype_name)


def load_for_gpu(model: str | None, device: str, dtype: str) -> GpuSetup:
    """Load ``model`` (None: the default) for a CUDA ``device`` (cuda or cuda:N); ``dtype``
    auto picks what the engine would there. ValueError for a device that is not CUDA."""
    if not device.startswith("cuda"):
        raise ValueError(f"--device must be cuda or cuda:N, got {device!r}")
    device_name = resolve_device(device)  # refuses a GPU this process does not see
    dtype_name = resolve_dtype(dtype, device_name)
    source = resolve_model_source(model)
    hf_model, tokenizer = load_hf_model(source)
    loaded32 = loaded_from_hf_model(hf_model, tokenizer, source.name, torch.float32)
    loaded = (loaded32 if dtype_name == "float32"
              else loaded_from_hf_model(hf_model, tokenizer, source.name, torch_dtype(dtype_name)))
    return GpuSetup(source.name, torch.device(device_name), dtype_name, hf_model, tokenizer, loaded32, loaded)
