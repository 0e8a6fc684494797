"""Typed messages between the router and the workers (Ray actor calls). Torch-free, so
that the router can import them."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from tandem.logprobs import TopLogprobs
from tandem.sampling_params import SamplingParams


class _HasRequestId(Protocol):
    @property
    def request_id(self) -> str: ...


T = TypeVar("T", bound=_HasRequestId)


class Role(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"


@dataclass(frozen=True)
class KVSource:
    """Another worker whose KV tiers hold more of a request's prefix than the worker handed
    the request: it fetches the blocks it lacks from there before admitting the request
    (kvtransfer/tier_peer.py) instead of computing them."""

    address: str
    """The other worker's tier server (tcp://HOST:PORT)."""
    num_blocks: int
    """The prompt's leading full blocks the other worker holds, counted from the first."""


@dataclass(frozen=True)
class WorkerRequest:
    """One generation request as the router hands it to a worker."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    """vLLM's request priority: under ``--scheduling-policy priority`` lower is served first
    (ties in arrival order); the router sends 0 to workers of any other policy."""
    num_resumed_tokens: int = 0
    """The last this many of prompt_token_ids are output the client already has: the request
    moved here mid-stream (router/migration.py) and goes on from them. The worker computes
    them with the prompt and counts, penalizes, constrains and detokenizes them as output
    (their text is not sent again); only n=1 requests resume."""
    kv_source: KVSource | None = None
    """Where to fetch prefix blocks this worker lacks from (None: compute them)."""


def checked(value: Any, cls: type[T], what: str) -> T:
    """`value` if it is a `cls` with a non-empty string request_id (a worker's Ray methods
    check what they are given: a malformed call must fail alone, touching nothing)."""
    if not isinstance(value, cls):
        raise TypeError(f"{what} must be a {cls.__name__}, got {type(value).__name__}")
    if not isinstance(value.request_id, str) or not value.request_id:
        raise ValueError(f"{what}.request_id must be a non-empty string, got {value.request_id!r}")
    if isinstance(value, WorkerRequest) and not (isinstance(value.params, SamplingParams)
                                                 and isinstance(value.prompt_token_ids, list)
                                                 and type(value.priority) is int
                                                 and type(value.num_resumed_tokens) is int
                                                 and (value.kv_source is None or _is_kv_source(value.kv_source))):
        raise TypeError(f"{what}: params must be SamplingParams, prompt_token_ids a list, priority and "
                        "num_resumed_tokens ints, and kv_source None or a KVSource")
    return value


def _is_kv_source(source: Any) -> bool:
    return (isinstance(source, KVSource) and isinstance(source.address, str) and type(source.num_blocks) is int
            and source.num_blocks >= 0)


@dataclass(frozen=True)
class PrefillResult:
    """What a prefill worker returns once the prompt's KV is computed and sent: the prompt's
    first sample (tandem.outputs.FirstSample, in bytes)."""

    request_id: str
    token_ids: list[int]
    """The first token of each completion (SamplingParams.n of them), or with beam search
    the prompt's top candidates, best first."""
    logprobs: list[float]
    """The log-probability of each of token_ids."""
    num_cached_tokens: int
    """Prompt tokens the prefill worker found in its prefix cache."""
    top_logprobs: list[TopLogprobs] = field(default_factory=list)
    """With SamplingParams.logprobs = N >= 1: the N most likely tokens at the first position,
    one entry per completion (the same prompt, so the same entry n times); else empty."""


@dataclass(frozen=True)
class StreamDelta:
    """One step's new output of a request, streamed from the decode (or colocated) worker."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None
    """None until the last delta; then "stop", "length" or "abort"."""
    num_prompt_tokens: int
    num_output_tokens: int
    logprobs: list[float] | None = None
    """The log-probability of each of token_ids (SamplingParams.logprobs set), else None."""
    top_logprobs: list[TopLogprobs] | None = None
    """With SamplingParams.logprobs = N >= 1: the N most likely tokens at each of token_ids'
    positions, else None."""
    error: str | None = None
    """Set (on the last delta) when the request failed on the workers, e.g. its KV never came."""
    index: int = 0
    """Which completion the tokens belong to (0 .. n-1: see SamplingParams.n)."""
    num_unfinished: int = 0
    """Completions of the request still going after this delta (finish_reason is that of
    completion `index`); the request's last delta has it 0. num_output_tokens counts the
    tokens of every completion."""
    num_cached_tokens: int = 0
    """Prompt tokens the streaming worker found in its prefix cache (on a decode worker: the
    ones whose KV was not transferred), as its engine counted them when it admitted the
    prompt: on every delta from then on, so the request's first delta with tokens carries it
    (the router compares it with the hit it predicted). 0 on deltas made outside the engine
    (an abort before the prompt was admitted, the engine down)."""

    @property
    def request_finished(self) -> bool:
        """The request's last delta: every completion has finished (or it failed)."""
        return self.error is not None or (self.finish_reason is not None and self.num_unfinished == 0)


@dataclass(frozen=True)
class WorkerLoad:
    """A worker's load, for routing policies and health."""

    role: Role
    instance: str
    num_blocks: int
    num_free_blocks: int
    num_running: int
    num_waiting: int
    num_queued_tokens: int
    """Prompt tokens waiting to be prefilled."""
    block_size: int = 16
    """Tokens per KV block: the router hashes prompts in blocks this long to guess which
    prefixes the worker holds (see router/prefix_index.py)."""
    num_prompt_tokens: int = 0
    """Prompt tokens computed since the worker started (prefix cache hits excluded)."""
    num_generated_tokens: int = 0
    """Tokens sampled since the worker started (a prefill worker's: first tokens)."""
    num_prefix_queries: int = 0
    """Prompt tokens looked up in the prefix cache since the worker started."""
    num_prefix_hits: int = 0
    """Of those, the ones found."""


@dataclass(frozen=True)
class TokenizerSpec:
    """Everything the router needs to tokenize without transformers or torch."""

    tokenizer_json: str
    """The fast tokenizer's JSON (tokenizers.Tokenizer.from_str)."""
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    add_bos_token: bool
    model_name: str
    vocab_size: int
    max_model_len: int
    sampling_defaults: tuple[tuple[str, float | int], ...] = ()
    """(SamplingParams field, default) from the model's generation_config.json: what a request
    that leaves the field unset gets (vLLM's --generation-config auto)."""
    scheduling_policy: str = "fcfs"
    """The workers' --scheduling-policy: the router refuses a nonzero priority unless it is priority."""


class PoolFull(RuntimeError):
    """The worker cannot take the request now (no free blocks); another may."""


class EngineDown(RuntimeError):
    """The worker's engine loop stopped on an error: every call on it fails with this while
    the worker ends its process (Ray then restarts it)."""


@dataclass(frozen=True)
class WorkerInventory:
    """Everything a worker holds for requests, read on its engine loop thread between steps:
    a worker at rest (every request ended) holds nothing (see `leaks`)."""

    role: Role
    instance: str
    num_waiting: int
    num_running: int
    num_sequences: int
    """Requests the engine knows (waiting, running, or reserved for a prefill elsewhere)."""
    num_open_streams: int
    """Output streams open on the worker (decode, colocated)."""
    num_blocks: int
    num_free_blocks: int
    num_referenced_blocks: int
    """Blocks with a nonzero reference count."""
    num_reserved: int = 0
    """Decode: sequences holding blocks for KV that has not started decoding."""
    num_first_tokens: int = 0
    """Decode: first tokens held until their KV arrives."""
    num_arrived: int = 0
    """Decode: requests whose KV arrived, waiting for their first token."""
    num_pending_transfers: int = 0
    """The KV sender's (prefill) or receiver's (decode) requests not yet ended."""
    num_kept: int = 0
    """Prefill: sequences whose blocks are kept until their transfer ends."""
    num_aborting: int = 0
    """Decode: aborted requests whose blocks wait for a same-node writer stopped inside a write
    (they go back to the pool once its grant is revoked)."""
    num_swapped_blocks: int = 0
    """Host blocks holding swapped-out KV."""

    def leaks(self) -> list[str]:
        """What this worker still holds, e.g. ["num_running=1", "3 of 40 blocks in use"]; [] at rest."""
        held = [f"{name}={getattr(self, name)}" for name in (
            "num_waiting", "num_running", "num_sequences", "num_reserved", "num_first_tokens", "num_arrived",
            "num_pending_transfers", "num_open_streams", "num_referenced_blocks", "num_kept",
            "num_swapped_blocks", "num_aborting")
            if getattr(self, name)]
        if self.num_free_blocks != self.num_blocks:
            held.append(f"{self.num_blocks - self.num_free_blocks} of {self.num_blocks} blocks in use")
        return held

    @property
    def is_empty(self) -> bool:
        return not self.leaks()
