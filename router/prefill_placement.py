"""One request's place in a disaggregated cluster: its decode worker, where its prompt is
prefilled (router/disagg.py decides), and the router's own counts of what it has placed,
kept from the moment of the choice (not from the worker's answer, which a burst does not
wait for) until the prompt is prefilled. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from tandem.router.backend import NoHealthyWorker
from tandem.router.disagg import DisaggPolicy, PrefillChoice, PrefillCosts, PrefillInputs, Where
from tandem.router.policy import Router, Sent, WorkerState
from tandem.router.prefix_prediction import PrefixPrediction
from tandem.worker.api import KVSource


@dataclass
class PrefillPlacement:
    """A request placed on ``decode`` (prefilled there when ``choice`` is local, else on ``prefill``)."""

    decode: WorkerState
    choice: PrefillChoice
    inputs: PrefillInputs
    prefill: WorkerState | None
    """The prefill worker of a remote prefill (None for a local one)."""
    sent: Sent
    """The placement on the decode worker, counted until its load shows it."""
    decided_at: float
    """Event-loop seconds at the decision (the cost estimates' observations start here)."""
    destination: Any = None
    """Where a remote prefill sends the KV: the decode worker's reservation."""
    kv_source: KVSource | None = None
    """Where the prefill worker fetches prefix blocks it lacks (router/kv_sources.py)."""
    prefix_prediction: PrefixPrediction | None = None
    """A remote prefill's predicted prefix hit on its prefill worker (prefix-aware policies)."""
    _num_pending_tokens: int = 0
    _pending_on: WorkerState | None = None

    @property
    def is_local(self) -> bool:
        return self.choice.where is Where.LOCAL

    def hold_prompt(self) -> None:
        """Count the prompt as queued on the worker that will prefill it, until ``release_prompt``."""
        worker = self.decode if self.is_local else self.prefill
        assert worker is not None and self._pending_on is None
        self._num_pending_tokens = self.inputs.num_uncached_local if self.is_local else self.inputs.num_uncached_remote
        self._pending_on = worker
        worker.num_in_flight += 1
        worker.num_in_flight_tokens += self._num_pending_tokens

    def release_prompt(self) -> None:
        """The prompt is prefilled, or will not be (idempotent)."""
        worker, self._pending_on = self._pending_on, None
        if worker is not None:
            worker.num_in_flight -= 1
            worker.num_in_flight_tokens -= self._num_pending_tokens


def place_colocated(worker: WorkerState, num_prompt_tokens: int) -> Callable[[], None]:
    """Count a request on a colocated worker at once (its call queues the prompt on arrival) ->
    a release to call when its first token comes, or it ends (idempotent)."""
    worker.placed(worker.place(num_blocks_for(worker, num_prompt_tokens)), took=True)
    worker.num_in_flight_tokens += num_prompt_tokens
    held = [num_prompt_tokens]

    def release() -> None:
        worker.num_in_flight_tokens -= held.pop() if held else 0
    return release


def num_blocks_for(worker: WorkerState, num_tokens: int) -> int:
    """Blocks ``num_tokens`` (and the first output token) take on ``worker``."""
    block_size = worker.load.block_size if worker.load is not None else 16
    return -(-(num_tokens + 1) // block_size)


def prefill_inputs(decode_router: Router, prefill_router: Router, decode: WorkerState, prefill: WorkerState | None,
                   prompt_token_ids: list[int], cache_salt: str | None) -> PrefillInputs:
    """What the disaggregation policy weighs for this request on these two workers: the
    router's view of each (reported load plus what it placed since)."""
    n = len(prompt_token_ids)
    decode_queued, decode_num_seqs, _ = decode.pressure()
    return PrefillInputs(
        num_prompt_tokens=n,
        num_uncached_remote=n - (prefill_router.num_cached_tokens(prefill, prompt_token_ids, cache_salt)
                                 if prefill is not None else 0),
        num_uncached_local=n - decode_router.num_cached_tokens(decode, prompt_token_ids, cache_salt),
        prefill_pending_tokens=prefill.pressure()[0] if prefill is not None else 0,
        decode_pending_tokens=decode_queued,
        decode_num_running=decode_num_seqs,
        has_prefill_worker=prefill is not None)


def place(policy: DisaggPolicy, decode_router: Router, prefill_router: Router, decode: WorkerState,
          prefill: WorkerState | None, prompt_token_ids: list[int], cache_salt: str | None,
          now: float) -> PrefillPlacement:
    """Decide where the prompt is prefilled and count the request on its workers at once.
    Raises NoHealthyWorker when the policy wants the prefill pool and none of it is healthy."""
    inputs = prefill_inputs(decode_router, prefill_router, decode, prefill, prompt_token_ids, cache_salt)
    choice = policy.decide(inputs)
    if choice.where is Where.REMOTE and prefill is None:
        raise NoHealthyWorker("no prefill worker is healthy")
    placement = PrefillPlacement(decode, choice, inputs, None if choice.where is Where.LOCAL else prefill,
                                 decode.place(num_blocks_for(decode, inputs.num_uncached_local)), now)
    placement.hold_prompt()
    return placement


def learn(costs: PrefillCosts, placement: PrefillPlacement, first_token_at: float,
          prefill_s: float | None) -> None:
    """The request's first token came at ``first_token_at`` (event-loop seconds); a remote
    one's prefill call took ``prefill_s``. Feeds the cost estimates the auto policy uses."""
    inputs = placement.inputs
    if placement.is_local:
        costs.observe_local(inputs.decode_pending_tokens + inputs.num_uncached_local,
                            first_token_at - placement.decided_at)
    elif prefill_s is not None:
        costs.observe_remote(inputs.prefill_pending_tokens + inputs.num_uncached_remote, prefill_s)
        costs.observe_handoff(first_token_at - placement.decided_at - prefill_s)
