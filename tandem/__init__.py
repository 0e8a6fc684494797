"""tandem: LLM serving with prefill and decode disaggregated into two pools.

The names below load on first use, so that torch-free parts (the router, the wire
messages) can import `tandem.*` modules without pulling in torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "tandem.llm",
    "SamplingParams": "tandem.sampling_params",
    "StructuredOutputsParams": "tandem.structured_outputs",
    "RequestOutput": "tandem.outputs",
    "RequestDelta": "tandem.outputs",
    "FinishReason": "tandem.engine.sequence",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tandem' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
