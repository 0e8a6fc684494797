"""How well a prefix-aware policy predicts prefix-cache hits: for each request it places on a
prefill or colocated worker, the prompt tokens the router predicted that worker holds against
those the worker then reports it found (``tandem_router_prefix_*_tokens_total``,
docs/metrics.md). A request that ends before its worker reports counts in neither. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.router.policy import PREFIX_POLICIES, Router, WorkerState
from tandem.worker.api import KVSource, Role

if TYPE_CHECKING:
    from tandem.router.metrics import RouterMetrics

PREDICTED_ROLES = (Role.PREFILL, Role.COLOCATED)
"""The workers whose hits are predicted and counted: those that compute prompts the router
sends them (a local prefill on a decode worker is left out)."""


@dataclass
class PrefixPrediction:
    """The prefix hit the router predicted, at placement, on the worker that runs a request's prompt."""

    policy: str
    role: Role
    num_predicted_tokens: int
    num_reported_tokens: int | None = None
    """Prompt tokens the worker reported it found in its prefix cache (None: not yet)."""

    def reported(self, num_cached_tokens: int, metrics: RouterMetrics | None) -> None:
        """The worker found ``num_cached_tokens`` prompt tokens in its prefix cache: count the
        prediction and the report, once (later calls change nothing)."""
        if self.num_reported_tokens is not None:
            return
        self.num_reported_tokens = num_cached_tokens
        if metrics is not None:
            metrics.prefix_prediction(self.policy, self.role.value, self.num_predicted_tokens, num_cached_tokens)


def predict(router: Router, role: Role, worker: WorkerState, prompt_token_ids: list[int],
            cache_salt: str | None, kv_source: KVSource | None = None) -> PrefixPrediction | None:
    """The hit ``router`` predicts for the prompt on ``worker``, the one it chose (None unless its
    policy predicts hits): what the worker holds, or what it was pointed to fetch
    (``kv_source``: it loads those blocks as hits), whichever is longer. Call before
    ``router.record``, which counts the prompt as held there."""
    if router.policy not in PREFIX_POLICIES:
        return None
    num_held = router.num_cached_tokens(worker, prompt_token_ids, cache_salt, weighted=False)
    num_fetched = 0 if kv_source is None or worker.load is None else kv_source.num_blocks * worker.load.block_size
    return PrefixPrediction(router.policy, role, max(num_held, num_fetched))
