"""Which device an engine runs on, and the dtype that ``auto`` picks there.

Resolved once, before an EngineConfig is built (configs are frozen with resolved names).
torch is imported only to ask about CUDA, so that the CPU case stays torch-free like
model_config.py.
"""

from __future__ import annotations

from tandem.config.names import AUTO, DTYPE_BYTES, auto_dtype_name, check_device_name


def resolve_device(name: str) -> str:
    """``auto`` -> ``cuda`` when this process sees a GPU, else ``cpu``; ``cuda``/``cuda:N`` are
    checked against the GPUs this process sees (a clear ValueError, at once, where there are
    none). -> cpu, cuda or cuda:N."""
    check_device_name(name)
    if name == "cpu":
        return name
    import torch

    num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if name == AUTO:
        return "cuda" if num_gpus else "cpu"
    index = int(name.partition(":")[2] or 0)
    if index >= num_gpus:
        sees = "no CUDA device" if num_gpus == 0 else f"{num_gpus} CUDA device(s)"
        raise ValueError(f"device {name}: this process sees {sees} (torch {torch.__version__}, "
                         f"CUDA_VISIBLE_DEVICES={_visible_devices()}); use --device cpu or auto")
    return name


def resolve_dtype(name: str, device: str) -> str:
    """``auto`` -> what auto_dtype_name picks on ``device`` (a resolved device); another name is
    checked and kept."""
    if name != AUTO:
        if name not in DTYPE_BYTES:
            raise ValueError(f"dtype must be auto or one of {', '.join(DTYPE_BYTES)}, got {name!r}")
        return name
    if device == "cpu":
        return auto_dtype_name(device)
    import torch

    return auto_dtype_name(device, torch.cuda.is_bf16_supported())


def _visible_devices() -> str:
    import os

    return os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
