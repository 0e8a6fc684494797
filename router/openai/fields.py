"""Readers of one JSON body field each: the value as its Python type, or a 400 naming the
field and what it got (its JSON kind, never the client's value itself)."""

from __future__ import annotations

from tandem.router.openai.errors import invalid

_INT32 = 2**31 - 1
_INT64 = 2**63 - 1


def json_kind(value: object) -> str:
    """What a JSON value is, for messages (never the client's value itself)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def integer(name: str, value: object, most: int = _INT32) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(name, f"must be an integer, got {json_kind(value)}")
    if not -most - 1 <= value <= most:
        raise invalid(name, f"must be between {-most - 1} and {most}")
    return value


def int64(name: str, value: object) -> int:
    return integer(name, value, _INT64)


def number(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(name, f"must be a number, got {json_kind(value)}")
    try:
        return float(value)
    except OverflowError:  # an integer with hundreds of digits
        raise invalid(name, "is out of range") from None


def boolean(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise invalid(name, f"must be a boolean, got {json_kind(value)}")
    return value


def string(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise invalid(name, f"must be a string, got {json_kind(value)}")
    return value
