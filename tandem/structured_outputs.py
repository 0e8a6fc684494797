"""What a request's output must match (vLLM's ``StructuredOutputsParams``): plain values that
cross from the router to the workers, where tandem/decoding/grammar*.py compiles them."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

MAX_CHOICES = 256


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one constraint. Invalid values raise ``ValueError`` naming the field."""

    json: str | None = None
    """A JSON Schema as JSON text (a dict is accepted and dumped): the output is one JSON value
    that validates against it."""
    json_object: bool = False
    """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
    regex: str | None = None
    """A regular expression that the whole output matches (xgrammar's subset of the usual
    syntax: no inline flags such as ``(?i)``, no backreferences)."""
    choice: tuple[str, ...] = ()
    """The output is exactly one of these non-empty strings."""

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            # (In the dict's own order: the grammar lays properties out in schema order.)
            object.__setattr__(self, "json", json.dumps(self.json))
        object.__setattr__(self, "choice", tuple(self.choice))
        num_set = sum((self.json is not None, bool(self.json_object), self.regex is not None, bool(self.choice)))
        _check(num_set == 1, "json", f"exactly one of json, json_object, regex and choice must be set, got {num_set}")
        if self.json is not None:
            _check(isinstance(self.json, str), "json", "must be a JSON Schema (a JSON object or its text)")
            try:
                schema: Any = json.loads(self.json)
            except (ValueError, RecursionError) as e:
                raise ValueError(f"StructuredOutputsParams.json is not valid JSON ({type(e).__name__}: "
                                 f"{str(e)[:80]})") from None
            _check(isinstance(schema, (dict, bool)), "json", "must be a JSON Schema: an object or true/false")
        _check(self.regex is None or (isinstance(self.regex, str) and self.regex != ""),
               "regex", "must be a non-empty string")
        _check(len(self.choice) <= MAX_CHOICES and all(isinstance(c, str) and c for c in self.choice),
               "choice", f"must be at most {MAX_CHOICES} non-empty strings")

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): what identifies the compiled grammar (a compile cache's key)."""
        if self.json is not None:
            return "json", self.json
        if self.json_object:
            return "json_object", ""
        if self.regex is not None:
            return "regex", self.regex
        return "choice", json.dumps(self.choice)


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"StructuredOutputsParams.{name} {message}")
