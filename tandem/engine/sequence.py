"""One request's state inside an engine: its sequences and, when it runs several at once, their
group. Only the scheduler moves them forward."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import TYPE_CHECKING, Callable

from tandem.decoding.beam_search import BeamSearch, Hypothesis
from tandem.engine.detokenizer import IncrementalDetokenizer
from tandem.logprobs import TopLogprobs
from tandem.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tandem.decoding.grammar import GrammarMatcher


class SequenceStatus(IntEnum):
    """Ordered: every status from FINISHED_STOPPED on is final."""

    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    """Preempted with its KV in host blocks: resumes (before any waiting one) where it stopped."""
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_UNSATISFIABLE = 6
    """Structured outputs: the logits processors (min_tokens, logit_bias) left no token the
    grammar allows. The output so far is a valid prefix; clients see it end "abort"."""

    @property
    def is_finished(self) -> bool:
        return self >= SequenceStatus.FINISHED_STOPPED


class FinishReason(str, Enum):
    """Why a request ended, as clients see it (OpenAI's and vLLM's words)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


FINISH_REASONS = {
    SequenceStatus.FINISHED_STOPPED: FinishReason.STOP,
    SequenceStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    SequenceStatus.FINISHED_ABORTED: FinishReason.ABORT,
    # NOTE: "abort", not a word of our own: OpenAI's clients and the wire (proto FinishReason)
    # know stop/length/abort only, and abort tells them the output did not end as asked.
    SequenceStatus.FINISHED_UNSATISFIABLE: FinishReason.ABORT,
}


class Sequence:
    """Tokens, KV blocks and progress of one request.

    ``num_computed_tokens`` counts the tokens whose KV is in the cache; the tokens from
    there to ``num_tokens`` are still to be run through the model (the prompt, a chunk
    of it, or the last sampled token).
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_index: int,
        detokenizer: IncrementalDetokenizer | None = None,
        index: int = 0,
        grammar: GrammarMatcher | None = None,
    ) -> None:
        """grammar: the matcher of the request's structured outputs, at the output's start."""
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.arrival_index = arrival_index
        self.detokenizer = detokenizer
        self.index = index
        self.grammar = grammar
        """Where the output is in its grammar (advanced with every token it takes)."""
        """Which of its request's completions this is (0 .. n-1; see SamplingParams.n)."""
        self.group: SequenceGroup | None = None
        """The request's other sequences, when it has several (n > 1, beam search)."""
        self.status = SequenceStatus.WAITING
        self.token_ids: list[int] = list(prompt_token_ids)
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[TopLogprobs] = []
        """Per output token when SamplingParams.logprobs >= 1 (else empty)."""
        self.num_computed_tokens = 0
        self.num_cached_prompt_tokens = 0
        """Prompt tokens found in the prefix cache at first admission."""
        self.num_preemptions = 0
        self.priority = 0
        """Its request's priority (vLLM's): under the priority scheduling policy, lower is
        served first (waiting_queue.py); set by the engine as the request arrives."""
        # Timestamps (time.monotonic) for the metrics: set once each, by the scheduler.
        self.arrival_time = time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.block_ids: list[int] = []
        """The block table: block i holds tokens [i * block_size, (i + 1) * block_size)."""
        self.block_hashes: list[bytes] = []
        """Chained hashes of this sequence's full, computed blocks, in order."""
        self.host_block_ids: list[int] = []
        """While SWAPPED: the host blocks holding its computed KV, in block-table order."""
        self.keep_blocks = False
        """When set, finishing leaves the blocks with the sequence and its owner frees them
        (a prefill worker, once the KV it sends from them has arrived)."""
        self.num_resumed_tokens = 0
        """Output tokens it was created with (a request resumed mid-stream: :meth:`resume`)."""

    def resume(self, token_ids: list[int]) -> None:
        """Take ``token_ids`` as the output so far, before any is computed (a request moved
        here mid-stream continues from them): its grammar and text follow them, and the text
        they make is dropped (its client has it), except what a stop string's possible start
        holds back, which goes out as the original would have sent it. ValueError when they
        break the request's grammar."""
        assert self.num_computed_tokens == 0 and not self.num_output_tokens
        for position, token_id in enumerate(token_ids):
            if self.grammar is not None and not self.grammar.accept_token(token_id):
                raise ValueError(f"resumed token {token_id} at output position {position} does not follow "
                                 "the request's structured output")
            if self.detokenizer is not None:
                self.detokenizer.append(token_id)
        self.token_ids.extend(token_ids)
        self.num_resumed_tokens = len(token_ids)

    def take_progress(self, parent: Sequence) -> None:
        """Start from where ``parent`` is (a fork): its tokens and timestamps; the blocks are
        the block manager's (BlockManager.fork)."""
        self.token_ids = list(parent.token_ids)
        self.output_logprobs = list(parent.output_logprobs)
        self.output_top_logprobs = list(parent.output_top_logprobs)
        self.num_computed_tokens = parent.num_computed_tokens
        self.num_cached_prompt_tokens = parent.num_cached_prompt_tokens
        self.priority = parent.priority
        self.arrival_time = parent.arrival_time
        self.first_scheduled_time = parent.first_scheduled_time
        self.first_token_time = parent.first_token_time

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def finish_reason(self) -> FinishReason | None:
        return FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_ids})"
        )


@dataclass(frozen=True)
class SequenceUpdate:
    """What one step added to a sequence: a token (or several, with speculation), its text, maybe the end."""

    seq: Sequence
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[float]
    new_top_logprobs: list[TopLogprobs] = field(default_factory=list)
    """Per new token when the request asks for top log-probabilities, else empty."""


class SequenceGroup:
    """One request's sequences. The root computes the prompt; at its first sample the
    others fork from it, sharing its KV blocks (copy-on-write)."""

    def __init__(self, root: Sequence, forks: list[Sequence], beam: BeamSearch[Sequence, SequenceStatus] | None,
                 new_detokenizer: Callable[[], IncrementalDetokenizer | None]) -> None:
        """forks: completions 1 .. n-1 (parallel sampling), dormant until the root's first
        sample; beam: the search state (beam search; then forks is empty)."""
        self.root = root
        self.forks = forks
        self.completions: list[Sequence] = [root, *forks]
        """In index order; with beam search, the best hypotheses once the search is done."""
        self.beam = beam
        self.beams: list[tuple[Sequence, float]] = [(root, 0.0)]
        """Beam search: the live beams and their summed log-probabilities."""
        self.candidates: dict[int, list[tuple[int, float]]] = {}
        """Beam search: each live beam's (by id) top candidates, once it has sampled this step."""
        self.first_candidates: tuple[list[int], list[float]] | None = None
        """Beam search: the root's candidates after the prompt (what a prefill worker hands on)."""
        self.new_detokenizer = new_detokenizer
        self.num_open = root.params.n
        """Completions whose last delta has not gone out yet (the engine counts them down)."""
        for seq in self.completions:
            seq.group = self

    @property
    def num_output_tokens(self) -> int:
        return sum(s.num_output_tokens for s in self.completions)

    def take_forks(self) -> list[Sequence]:
        """The dormant completions, once: they fork from the root now."""
        forks, self.forks = self.forks, []
        return forks

    def may_step_beams(self) -> bool:
        """Every live beam has sampled this step."""
        return all(id(seq) in self.candidates for seq, _ in self.beams)

    def hypotheses(self, finished: list[Hypothesis[Sequence, SequenceStatus]]) -> list[Sequence]:
        """The n best finished beams as sequences holding no blocks (index = rank)."""
        root = self.root
        results = []
        for index, h in enumerate(finished[:root.params.n]):
            c = h.continuation
            seq = Sequence(root.request_id, root.prompt_token_ids, root.params, root.arrival_index,
                           self.new_detokenizer(), index)
            seq.take_progress(c.parent)
            seq.token_ids.append(c.token_id)
            seq.output_logprobs.append(c.logprob)
            assert c.end is not None  # a hypothesis is a beam that ended
            seq.status = c.end
            seq.group = self
            results.append(seq)
        self.completions = results
        return results


def check_resumable(params: SamplingParams, num_tokens: int, num_resumed_tokens: int) -> None:
    """ValueError unless a request of ``num_tokens`` prompt tokens may take its last
    ``num_resumed_tokens`` as output already made: one sampled completion (a migrated
    request's completions resume one by one), at least one prompt token before them."""
    if not isinstance(num_resumed_tokens, int) or not 0 <= num_resumed_tokens < num_tokens:
        raise ValueError(f"num_resumed_tokens must be an integer in [0, {num_tokens}), got {num_resumed_tokens!r}")
    if num_resumed_tokens and (params.n != 1 or params.use_beam_search):
        raise ValueError("only a request of one sampled completion (n=1, no beam search) resumes mid-stream")
    if num_resumed_tokens >= params.max_tokens:
        raise ValueError(f"{num_resumed_tokens} resumed tokens leave nothing of max_tokens={params.max_tokens}")
