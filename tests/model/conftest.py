"""Fixtures shared by the model tests."""

from __future__ import annotations

import pytest

from tandem.model.llama import ModelWeights
from tandem.model.quantization import quantize_weights


@pytest.fixture(scope="session")
def int4_weights(loaded) -> ModelWeights:
    """The default model's weights as its GGUF file serves them (int4 projections, an int8 LM
    head), quantized once (about 10 s) for every test that runs them."""
    return quantize_weights(loaded.weights, "int4")
