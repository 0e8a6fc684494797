"""What ``--quantization auto`` keeps of a model's own format: a GGUF file's projections are
served in the form their blocks have (Q4_1 as int4, bit-exactly: gguf_q4.py; Q8_0 as int8
per output channel, re-quantized from the blocks' values), anything else as float."""

from __future__ import annotations

from tandem.model.gguf_index import gguf_index
from tandem.model.gguf_q4 import gguf_path
from tandem.model.gptq_awq import is_quantized_checkpoint
from tandem.model.source import ModelSource

FORMAT_OF_GGML_TYPE = {"Q4_1": "int4", "Q8_0": "int8"}
"""The projections' GGML type -> the quantization that serves it."""
PROBE_TENSOR = "blk.0.attn_q.weight"
"""The tensor whose type stands for the file's projections (quantizers give a file's
projections one type, bar a few layers some mixes keep wider)."""


def resolve_quantization(name: str | None, source: ModelSource | None) -> str | None:
    """``--quantization`` as the engine runs it: auto -> the source's own format (None for float
    weights, and for GPTQ/AWQ checkpoints, which load as int4 already); none -> None."""
    if name in (None, "none"):
        return None
    if name != "auto":
        return name
    path = gguf_path(source)
    if path is None or (source is not None and is_quantized_checkpoint(source)):
        return None
    probe = gguf_index(path).tensors.get(PROBE_TENSOR)
    return None if probe is None else FORMAT_OF_GGML_TYPE.get(probe.type_name)
