"""What one request may cost: the router refuses anything past these limits with
INVALID_ARGUMENT, naming the limit and the field, before any worker sees the request.

Each limit is a ``tandem serve`` flag (``--max-stop-strings`` for ``max_stop_strings``, ...),
handed to ``serve(..., limits=RequestLimits(...))``. The model's context length
(``max_model_len``, from the workers) bounds every request besides: a prompt keeps one
position free for the output, and prompt tokens + ``sampling.max_tokens`` must fit in it.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from tandem.router.migration import DEFAULT_MAX_MIGRATIONS

DEFAULT_MAX_PROMPT_CHARS = 2**20
"""Bounds the tokenizer's work per request: 1 Mi characters take about 0.8 s of one core to
tokenize (2-core CPU), and hold far more than any context's worth of tokens. (gRPC's own
4 MiB limit on a received message bounds requests at a bigger size: RESOURCE_EXHAUSTED.)"""


@dataclass(frozen=True)
class RequestLimits:
    """Per-request limits; every error message names the limit (``max_stop_strings=16``)."""

    max_prompt_tokens: int | None = None
    """Most prompt tokens (after tokenization and the chat template); None: the model's
    max_model_len - 1 (one position stays free for the output). Never more than that."""
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS
    """Most characters of text before tokenizing: ``prompt``, or all messages' contents
    together (protects the tokenizer and the chat template from enormous inputs)."""
    max_messages: int = 512
    """Most messages in a conversation."""
    max_stop_strings: int = 16
    """Most entries of ``sampling.stop`` (each is searched for after every token)."""
    max_stop_string_length: int = 256
    """Most characters in one stop string."""
    max_stop_token_ids: int = 64
    """Most entries of ``sampling.stop_token_ids``."""
    max_logit_bias_tokens: int = 300
    """Most entries of ``sampling.logit_bias`` (OpenAI's bound)."""
    max_completions: int = 16
    """Most completions per request: ``sampling.n``, and with beam search ``sampling.beam_width``
    (each completion or beam is a sequence that takes a batch slot and KV blocks of its own)."""
    max_prompts: int = 128
    """Most prompts in one OpenAI completions request (a list of prompts): each runs as a
    request of its own, holding one of the max_concurrent_requests places; their characters
    together stay within max_prompt_chars."""
    max_structured_output_chars: int = 2**16
    """Most characters of an output constraint (``sampling.structured_outputs``: a JSON Schema's
    text, a regular expression, or all choices together): what a worker compiles into a grammar."""
    max_concurrent_requests: int = 4096
    """Most Generate calls in progress at once, waiting ones included; past it a new call gets
    RESOURCE_EXHAUSTED at once (what bounds the router's and the workers' queues under overload)."""
    max_body_bytes_in_flight: int = 256 * 2**20
    """Most bytes of HTTP request bodies being received at once (each reserves its declared
    length before it is read); past it a new request gets 503 at once."""
    body_read_timeout_s: int = 30
    """Seconds an HTTP request body may take to arrive (a slow upload then gets 408)."""
    max_migrations: int = DEFAULT_MAX_MIGRATIONS
    """Times one streaming request may move to another worker when its worker fails (dies, hangs
    or is drained: router/migration.py); one more failure reaches its client as UNAVAILABLE."""

    @property
    def max_body_bytes(self) -> int:
        """The largest request body (HTTP) or message (gRPC) received: room for
        max_prompt_chars of text even when JSON escapes every character (``\\uXXXX``, 6 bytes),
        plus the other fields; at least gRPC's usual 4 MiB."""
        return max(4 * 2**20, 6 * self.max_prompt_chars + 2**20)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.name == "max_prompt_tokens":
                continue
            least = _least(f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"RequestLimits.{f.name} must be an integer >= {least}, got {value!r}")

    def prompt_token_limit(self, max_model_len: int) -> int:
        """The prompt tokens allowed for a model of this context length."""
        room = max_model_len - 1
        return room if self.max_prompt_tokens is None else min(self.max_prompt_tokens, room)


def _least(name: str) -> int:
    """The smallest value a limit takes (0 for the counts of optional lists: none allowed)."""
    return 0 if name in ("max_stop_strings", "max_stop_token_ids", "max_logit_bias_tokens", "max_migrations") else 1


def _int_at_least(least: int):
    def parse(text: str) -> int:
        value = int(text)
        if value < least:
            raise argparse.ArgumentTypeError(f"must be an integer >= {least}, got {value}")
        return value

    parse.__name__ = "integer"  # argparse's word in "invalid integer value"
    return parse


# (flag, field, help) for `tandem serve`.
_FLAGS = (
    ("--max-prompt-tokens", "max_prompt_tokens",
     "most prompt tokens per request (default: the model's max_model_len - 1)"),
    ("--max-prompt-chars", "max_prompt_chars",
     "most characters of prompt or chat text per request, checked before tokenizing "
     f"(default {DEFAULT_MAX_PROMPT_CHARS})"),
    ("--max-messages", "max_messages", "most chat messages per request (default 512)"),
    ("--max-stop-strings", "max_stop_strings", "most stop strings per request (default 16)"),
    ("--max-stop-string-length", "max_stop_string_length", "most characters per stop string (default 256)"),
    ("--max-stop-token-ids", "max_stop_token_ids", "most stop token ids per request (default 64)"),
    ("--max-logit-bias-tokens", "max_logit_bias_tokens", "most logit_bias entries per request (default 300)"),
    ("--max-completions", "max_completions",
     "most completions per request: sampling.n, and beam_width with beam search (default 16)"),
    ("--max-prompts", "max_prompts",
     "most prompts in one OpenAI completions request, each a request of its own (default 128)"),
    ("--max-structured-output-chars", "max_structured_output_chars",
     "most characters of an output constraint (JSON Schema, regex, choices) per request (default 65536)"),
    ("--max-concurrent-requests", "max_concurrent_requests",
     "most Generate calls in progress at once; past it RESOURCE_EXHAUSTED (default 4096)"),
    ("--max-body-bytes-in-flight", "max_body_bytes_in_flight",
     "most bytes of HTTP request bodies received at once; past it 503 (default 268435456)"),
    ("--body-read-timeout-s", "body_read_timeout_s", "seconds an HTTP request body may take to arrive (default 30)"),
    ("--max-migrations", "max_migrations",
     "times a streaming request may move to another worker when its worker fails or is drained, going on "
     f"from the tokens already streamed; then UNAVAILABLE (default {DEFAULT_MAX_MIGRATIONS}; 0: never)"),
)


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    """The limits as command-line flags (unset: RequestLimits' defaults)."""
    group = parser.add_argument_group("request limits (past them: INVALID_ARGUMENT naming the limit)")
    for flag, name, text in _FLAGS:
        group.add_argument(flag, dest=name, type=_int_at_least(_least(name)), default=None, metavar="N", help=text)


def limits_from_args(args: argparse.Namespace) -> RequestLimits:
    """The flags that were given, over RequestLimits' defaults (a bad value: ValueError naming it)."""
    given = {name: getattr(args, name) for _, name, _ in _FLAGS if getattr(args, name, None) is not None}
    return RequestLimits(**given)
