"""The model a command runs, as vLLM names it: ``tandem serve MODEL`` (positional, or
``--model``), ``--revision``, and ``--served-model-name`` (the names clients ask for).
Torch-free: the router's parser uses it."""

from __future__ import annotations

import argparse

from tandem.config.engine_options import MODEL_HELP


def add_model_args(parser: argparse.ArgumentParser, served_names: bool = False) -> None:
    parser.add_argument("model_positional", nargs="?", default=None, metavar="MODEL", help=MODEL_HELP)
    parser.add_argument("--model", default=None, help="the same as MODEL (either may be given)")
    parser.add_argument("--revision", default=None,
                        help="a hub model's branch, tag or commit (default: main)")
    if served_names:
        parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                            help="the names clients ask for in `model` (the first one answers; default: the "
                                 "model's name: a hub id, a directory's or .gguf file's name)")


def model_of(args: argparse.Namespace) -> str | None:
    """The model given, as MODEL or --model (None: the embedded default); both, differing: refused."""
    if args.model_positional is not None and args.model is not None and args.model_positional != args.model:
        raise ValueError(f"two models given: {args.model_positional!r} and --model {args.model!r}")
    return args.model_positional if args.model_positional is not None else args.model
