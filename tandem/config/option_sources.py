"""A command's flags from two more places, as defaults the command line overrides: a YAML file
(``--config FILE``, keys named as the flags: ``max-num-seqs: 32`` or ``max_num_seqs: 32``) and
the environment (``TANDEM_MAX_NUM_SEQS=32``), the environment over the file."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

ENV_PREFIX = "TANDEM_"
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def add_config_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, metavar="FILE",
                        help="a YAML file of flags (keys as the flags' names, e.g. max-num-seqs: 32); "
                             f"{ENV_PREFIX}<FLAG> environment variables (e.g. {ENV_PREFIX}MAX_NUM_SEQS) come over "
                             "it, and the command line over both")


def option_defaults(parser: argparse.ArgumentParser, config_file: str | None,
                    environ: Mapping[str, str]) -> dict[str, Any]:
    """dest -> value for `parser`'s flags given in `config_file` or in `environ`."""
    flags = {a.dest: a for a in parser._actions if a.option_strings and a.dest not in ("help", "config")}
    found: dict[str, Any] = {}
    if config_file is not None:
        for key, value in _read_yaml(config_file).items():
            dest = str(key).lstrip("-").replace("-", "_")
            if dest not in flags:
                raise ValueError(f"--config {config_file}: no flag --{str(key).lstrip('-')}")
            found[dest] = _value(flags[dest], value, f"{config_file}: {key}")
    for dest, action in flags.items():
        name = ENV_PREFIX + dest.upper()
        if environ.get(name):
            found[dest] = _value(action, environ[name], name)
    return found


def _read_yaml(path: str) -> dict[str, Any]:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            loaded = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"--config: cannot read {path!r}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not YAML: {str(e)[:200]}") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ValueError(f"--config {path}: must map flags to values")
    return loaded


def _value(action: argparse.Action, value: Any, where: str) -> Any:
    """A value for `action` from text or YAML, converted as the command line would."""
    if action.nargs == 0:  # a switch (store_true, --x/--no-x)
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text not in TRUE + FALSE:
            raise ValueError(f"{where}: {value!r} is not a boolean")
        return text in TRUE
    if action.nargs in ("+", "*"):
        items = value.split() if isinstance(value, str) else list(value)
        return [_one(action, v, where) for v in items]
    return _one(action, value, where)


def _one(action: argparse.Action, value: Any, where: str) -> Any:
    if callable(action.type):  # (argparse's types here are all callables)
        try:
            value = action.type(value if isinstance(value, str) else str(value))
        except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
            raise ValueError(f"{where}: {value!r}: {e}") from None
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{where}: {value!r} is not one of {', '.join(map(str, action.choices))}")
    return value
