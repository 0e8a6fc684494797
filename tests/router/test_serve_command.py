"""``tandem serve`` and ``tandem chat`` flags that become engine options: --num-speculative-tokens."""

from __future__ import annotations

import argparse

import pytest

from tandem.cli import add_engine_args, engine_kwargs
from tandem.router import serve_command


def _serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve_command.add_args(parser)
    return parser.parse_args(list(argv))


def test_speculation_is_off_unless_asked():
    args = _serve_args()
    assert args.num_speculative_tokens == 0
    assert "num_speculative_tokens" not in serve_command.worker_args(args)


def test_num_speculative_tokens_reaches_every_worker():
    args = _serve_args("--num-speculative-tokens", "4", "--colocated", "2")
    assert serve_command.worker_args(args)["num_speculative_tokens"] == 4


def test_negative_num_speculative_tokens_is_refused_before_any_worker_starts():
    with pytest.raises(ValueError, match="--num-speculative-tokens must be >= 0, got -1"):
        serve_command.worker_args(_serve_args("--num-speculative-tokens", "-1"))


def test_chat_passes_num_speculative_tokens_to_its_engine():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args([]))["num_speculative_tokens"] == 0
    assert engine_kwargs(parser.parse_args(["--num-speculative-tokens", "3"]))["num_speculative_tokens"] == 3
