"""Fixtures of the detokenizer tests (test_detokenizer.py, test_detokenizer_sources.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.model.source import load_tokenizer, resolve_model_source


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer(resolve_model_source(None))


@pytest.fixture(params=[True, False], ids=["decode_stream", "window"])
def decode_stream(request: Any) -> bool:
    """Which text source: DecodeStream (the default for a fast tokenizer), or the window
    technique, forced."""
    return request.param
