"""--quantization auto serves a model in its own format: the embedded GGUF file's Q4_1
projections as int4 (kept bit-exactly: test_gguf_q4.py), a float checkpoint as float."""

from __future__ import annotations

import pytest

from tandem.engine.setup import engine_config_and_weights
from tandem.model.gguf_format import resolve_quantization
from tandem.model.int4 import Int4Weight
from tandem.model.quantization import Int8Weight
from tandem.model.source import resolve_model_source


@pytest.fixture(scope="module")
def gguf_source():
    return resolve_model_source(None)


def test_auto_is_the_file_s_own_format(gguf_source) -> None:
    assert gguf_source.gguf_file is not None
    assert resolve_quantization("auto", gguf_source) == "int4"  # the default file is Q4_1
    assert resolve_quantization("none", gguf_source) is None
    assert resolve_quantization("int8", gguf_source) == "int8"
    assert resolve_quantization("auto", None) is None  # weights given without their files: as they are


def test_the_default_engine_keeps_the_q4_1_blocks(loaded, gguf_source) -> None:
    config, on_device = engine_config_and_weights(loaded, dict(num_kv_blocks=8), gguf_source)
    assert config.quantization == "int4"
    layer = on_device.weights.layers[0]
    assert all(isinstance(w, Int4Weight) for w in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj))
    assert isinstance(on_device.weights.lm_head, Int8Weight)  # the file's Q8_0 output, per channel
    float_config, float_weights = engine_config_and_weights(loaded, dict(num_kv_blocks=8, quantization="none"),
                                                            gguf_source)
    assert float_config.quantization is None and float_weights.weights is loaded.weights
