"""Router fixtures: the router's tokenizer, built from the real default model's tokenizer."""

from __future__ import annotations

import pytest
from router_harness import MAX_MODEL_LEN, VOCAB_SIZE

from tandem.router.tokenizer import RouterTokenizer
from tandem.worker.tokenizer_spec import tokenizer_spec_from


@pytest.fixture(scope="session")
def router_tokenizer(tokenizer) -> RouterTokenizer:
    return RouterTokenizer.from_spec(tokenizer_spec_from(tokenizer, "SmolLM2-135M-Instruct", VOCAB_SIZE, MAX_MODEL_LEN))
