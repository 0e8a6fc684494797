"""The OpenAI-compatible API on a free loopback port, over any Backend, with OpenAI's own clients."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import openai

from tandem.router.auth import ApiKeys
from tandem.router.limits import RequestLimits
from tandem.router.metrics import RouterMetrics
from tandem.router.openai.app import OpenAIEndpoint, start_openai_endpoint

MODEL = "SmolLM2-135M-Instruct"
"""The model name the router tokenizer fixture describes (conftest.py)."""


@dataclass
class Served:
    endpoint: OpenAIEndpoint
    metrics: RouterMetrics
    api_key: str

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.endpoint.port}"

    @property
    def base_url(self) -> str:
        return f"{self.root}/v1"

    def async_client(self, api_key: str | None = None) -> openai.AsyncOpenAI:
        # max_retries=0: a 429 or 503 must reach the test, not be retried away.
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=api_key or self.api_key, max_retries=0, timeout=30)

    def sync_client(self, api_key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=api_key or self.api_key, max_retries=0, timeout=30)

    def count(self, name: str, **labels: str) -> float:
        """A router metric's sample (0 when absent)."""
        value = self.metrics.registry.get_sample_value(name, {"model_name": self.metrics.model_name, **labels})
        return value or 0.0


@contextlib.asynccontextmanager
async def openai_serving(backend, *, limits: RequestLimits | None = None,
                         auth_token: str | ApiKeys | None = None, model_names: list[str] | None = None,
                         admin_key: str | None = None) -> AsyncIterator[Served]:
    """start_openai_endpoint on 127.0.0.1, port 0, on the running loop; stopped after."""
    tokenizer = backend.tokenizer
    metrics = RouterMetrics(tokenizer.spec.model_name, tokenizer.max_model_len)
    endpoint = await start_openai_endpoint(backend, tokenizer, metrics, limits or RequestLimits(), "127.0.0.1", 0,
                                           auth_token, grace_s=0.5, model_names=model_names, admin_key=admin_key)
    try:
        yield Served(endpoint, metrics, auth_token if isinstance(auth_token, str) else "unused")
    finally:
        await endpoint.stop()
