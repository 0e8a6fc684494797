"""Where a request's prompt is prefilled: on the prefill pool (remote, then its KV moves to the
decode worker) or on the decode worker that will hold it (local, chunked inside its steps).

Disaggregation pays when a prompt is long enough that running it beside decoding streams
would stall them, and the prefill pool is not so backed up that waiting for it costs more than
the stall saves. A short chat prompt on an idle decode worker pays a remote prefill, a KV
transfer and a join for nothing. The policies here see only numbers (``PrefillInputs``) and
the router's running estimate of costs (``PrefillCosts``), so the router and ``tandem simulate``
decide with the same code. Torch-free.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Protocol


class Where(str, enum.Enum):
    REMOTE = "remote"
    """The prefill pool runs the prompt; its KV goes to the decode worker."""
    LOCAL = "local"
    """The decode worker runs the prompt itself, chunked inside its step budget."""


@dataclass(frozen=True)
class PrefillChoice:
    where: Where
    reason: str
    """Why, as a metric label: ``tandem_prefill_decisions_total{where,reason}``."""


@dataclass(frozen=True)
class PrefillInputs:
    """What the router knows of a request and of the two workers it would go to."""

    num_prompt_tokens: int
    num_uncached_remote: int
    """Prompt tokens the prefill worker would compute (its probable prefix hit left out)."""
    num_uncached_local: int
    """Prompt tokens the decode worker would compute (its probable prefix hit left out)."""
    prefill_pending_tokens: int
    """Prompt tokens ahead of this one on the prefill worker: queued there, or sent to it and
    not yet prefilled (0 when there is no healthy prefill worker)."""
    decode_pending_tokens: int
    """Prompt tokens ahead of this one on the decode worker (local prefills not yet done)."""
    decode_num_running: int
    """Sequences the decode worker is decoding (reported, plus those sent since)."""
    has_prefill_worker: bool


@dataclass
class PrefillCosts:
    """The router's running estimate of what a prompt token costs each way (seconds), learnt
    from the requests it has served (exponentially weighted) and seeded with a guess."""

    remote_s_per_token: float = 1e-3
    """Prefill pool time per prompt token, its queue included (from remote prefills)."""
    local_s_per_token: float = 1e-3
    """Decode worker time per prompt token it prefills, decoding beside it included."""
    handoff_s: float = 0.05
    """A remote prefill's fixed cost beyond its tokens: reservation, the KV's last layer, the join."""
    weight: float = 0.2
    """How much one new observation moves an estimate."""

    def observe_remote(self, num_tokens: int, seconds: float) -> None:
        """A remote prefill of ``num_tokens`` (its queue ahead included) took ``seconds``."""
        if num_tokens > 0 and seconds > 0:
            self.remote_s_per_token += self.weight * (seconds / num_tokens - self.remote_s_per_token)

    def observe_local(self, num_tokens: int, seconds: float) -> None:
        """A local prefill of ``num_tokens`` (its queue ahead included) took ``seconds`` to its first token."""
        if num_tokens > 0 and seconds > 0:
            self.local_s_per_token += self.weight * (seconds / num_tokens - self.local_s_per_token)

    def observe_handoff(self, seconds: float) -> None:
        """A remote prefill's first token came ``seconds`` after its prefill call returned
        (the reservation before it and the join after it)."""
        if seconds > 0:
            self.handoff_s += self.weight * (seconds - self.handoff_s)

    def remote_ttft_s(self, inputs: PrefillInputs) -> float:
        return (inputs.prefill_pending_tokens + inputs.num_uncached_remote) * self.remote_s_per_token + self.handoff_s

    def local_ttft_s(self, inputs: PrefillInputs) -> float:
        return (inputs.decode_pending_tokens + inputs.num_uncached_local) * self.local_s_per_token

    def local_stall_s(self, inputs: PrefillInputs) -> float:
        """What a local prefill adds, in all, to the decode worker's running streams' step times."""
        return inputs.num_uncached_local * self.local_s_per_token


class DisaggPolicy(Protocol):
    """Decides, for one request, where its prompt is prefilled."""

    def decide(self, inputs: PrefillInputs) -> PrefillChoice:
        ...


class Always:
    """Every prompt on the prefill pool (tandem's behaviour before per-request decisions): with
    no healthy prefill worker the request fails (UNAVAILABLE), as it always did."""

    def __init__(self, costs: PrefillCosts, max_local_stall_s: float) -> None:
        pass

    def decide(self, inputs: PrefillInputs) -> PrefillChoice:
        return PrefillChoice(Where.REMOTE, "policy_always")


class Never:
    """Every prompt on its decode worker: colocated behaviour on the same pools."""

    def __init__(self, costs: PrefillCosts, max_local_stall_s: float) -> None:
        pass

    def decide(self, inputs: PrefillInputs) -> PrefillChoice:
        return PrefillChoice(Where.LOCAL, "policy_never")


class Auto:
    """Local when it gives the earlier first token and stalls the decode worker's streams by
    at most ``max_local_stall_s`` in all (an idle decode worker has no stream to stall);
    otherwise remote.

    reasons: ``no_prefill_worker`` (local: the prefill pool is down, the decode workers serve
    on); local ``decode_idle`` or ``cheaper_local``; remote
    ``stalls_decode`` (local would be sooner but holds up running streams too long) or
    ``cheaper_remote``.
    """

    def __init__(self, costs: PrefillCosts, max_local_stall_s: float) -> None:
        self.costs = costs
        self.max_local_stall_s = max_local_stall_s

    def decide(self, inputs: PrefillInputs) -> PrefillChoice:
        if not inputs.has_prefill_worker:
            return PrefillChoice(Where.LOCAL, "no_prefill_worker")
        if self.costs.local_ttft_s(inputs) > self.costs.remote_ttft_s(inputs):
            return PrefillChoice(Where.REMOTE, "cheaper_remote")
        if inputs.decode_num_running == 0 and inputs.decode_pending_tokens == 0:
            return PrefillChoice(Where.LOCAL, "decode_idle")
        if self.costs.local_stall_s(inputs) <= self.max_local_stall_s:
            return PrefillChoice(Where.LOCAL, "cheaper_local")
        return PrefillChoice(Where.REMOTE, "stalls_decode")


DECISION_REASONS: tuple[tuple[Where, str], ...] = (
    (Where.LOCAL, "no_prefill_worker"), (Where.LOCAL, "policy_never"), (Where.LOCAL, "decode_idle"),
    (Where.LOCAL, "cheaper_local"), (Where.REMOTE, "policy_always"), (Where.REMOTE, "cheaper_remote"),
    (Where.REMOTE, "stalls_decode"))
"""Every (where, reason) a policy gives: the metric's series, from the start at 0."""

DISAGG_POLICIES: dict[str, Callable[[PrefillCosts, float], DisaggPolicy]] = {
    "auto": Auto, "always": Always, "never": Never}
"""--disagg-policy's choices: name -> factory(costs, max_local_stall_s)."""

DEFAULT_MAX_LOCAL_STALL_S = 0.1


def make_disagg_policy(name: str, costs: PrefillCosts | None = None,
                       max_local_stall_s: float = DEFAULT_MAX_LOCAL_STALL_S) -> DisaggPolicy:
    """The policy registered as ``name`` (ValueError naming the choices otherwise)."""
    try:
        factory = DISAGG_POLICIES[name]
    except KeyError:
        raise ValueError(f"--disagg-policy must be one of {', '.join(DISAGG_POLICIES)}, got {name!r}") from None
    return factory(costs if costs is not None else PrefillCosts(), max_local_stall_s)
