"""Output constraints in an OpenAI body -> ``tandem.v1.StructuredOutputs``, as vLLM reads them.

Three spellings, on both endpoints:

- OpenAI's ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}``;
- vLLM's ``structured_outputs``: ``{"json" | "regex" | "choice" | "json_object": ...}``;
- vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice``.

At most one constraint per request: two (from any spellings) are a 400 naming both. Only
shapes are checked here; what the constraint holds (valid JSON, sizes, non-empty choices)
is ``router.validation``'s, whose errors the caller renames to the field given here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tandem.proto import generation_pb2 as pb
from tandem.router.openai.errors import APIError
from tandem.router.openai.fields import json_kind
from tandem.router.validation import shown

RESPONSE_FORMATS = ("text", "json_object", "json_schema")
# Known fields of vLLM's structured_outputs beyond the constraints, each accepted only with a
# value that changes nothing here (tandem has one grammar backend, which never falls back).
_NEUTRAL_OPTIONS = {
    "disable_fallback": lambda v: isinstance(v, bool),
    "disable_any_whitespace": lambda v: v is False,
    "disable_additional_properties": lambda v: v is False,
    "backend": lambda v: isinstance(v, str),
}
_UNSUPPORTED = ("grammar", "structural_tag", "whitespace_pattern")
GUIDED = ("guided_json", "guided_regex", "guided_choice")
"""vLLM's older top-level fields, still read."""
BODY_FIELDS = ("response_format", "structured_outputs", *GUIDED)
"""The body parameters this module reads."""


@dataclass(frozen=True)
class Constraint:
    """One output constraint and where in the body it was given."""

    field: str
    """Its path in the body (``response_format.json_schema.schema``, ``guided_regex``, ...)."""
    message: pb.StructuredOutputs

    @property
    def param(self) -> str:
        """The body parameter that holds it (OpenAI's error ``param``)."""
        return self.field.split(".", 1)[0]


def output_constraint(given: dict[str, Any]) -> Constraint | None:
    """The request's constraint (None: free text) from the body's fields (null ones dropped)."""
    found: list[Constraint] = []
    if "response_format" in given:
        found.extend(_response_format(given["response_format"]))
    if "structured_outputs" in given:
        found.extend(_structured_outputs(given["structured_outputs"]))
    for name in GUIDED:
        if name in given:
            found.append(_constraint(name, name.removeprefix("guided_"), given[name]))
    if len(found) > 1:
        fields = ", ".join(c.field for c in found)
        raise APIError(400, f"{fields}: only one output constraint may be given per request, got {len(found)}",
                       param=found[0].param)
    return found[0] if found else None


def _invalid(field: str, message: str) -> APIError:
    return APIError(400, f"{field}: {message}", param=field.split(".", 1)[0].split("[", 1)[0])


def _response_format(value: object) -> list[Constraint]:
    if not isinstance(value, dict):
        raise _invalid("response_format", f"must be an object, got {json_kind(value)}")
    kind = value.get("type")
    if not isinstance(kind, str):
        raise _invalid("response_format.type", f"must be one of {', '.join(RESPONSE_FORMATS)}, got {json_kind(kind)}")
    if kind not in RESPONSE_FORMATS:
        raise _invalid("response_format.type", f"must be one of {', '.join(RESPONSE_FORMATS)}, got {shown(kind, 30)}")
    if kind == "text":
        return []
    if kind == "json_object":
        return [Constraint("response_format", pb.StructuredOutputs(json_object=True))]
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise _invalid("response_format.json_schema", f"must be an object with name and schema, got {json_kind(spec)}")
    _typed("response_format.json_schema.name", spec.get("name"), str)
    for name, kind in (("description", str), ("strict", bool)):  # strict or not, the schema is enforced
        if spec.get(name) is not None:
            _typed(f"response_format.json_schema.{name}", spec[name], kind)
    field = "response_format.json_schema.schema"
    schema = spec.get("schema")
    if not isinstance(schema, dict):
        raise _invalid(field, f"must be an object (a JSON Schema), got {json_kind(schema)}")
    return [Constraint(field, pb.StructuredOutputs(json_schema=_dumps(field, schema)))]


def _structured_outputs(value: object) -> list[Constraint]:
    if not isinstance(value, dict):
        raise _invalid("structured_outputs", f"must be an object, got {json_kind(value)}")
    found = []
    for key, entry in value.items():
        field = f"structured_outputs.{str(key)[:40]}"
        if entry is None:
            continue
        if key in ("json", "regex", "choice"):
            found.append(_constraint(field, key, entry))
        elif key == "json_object":
            if _typed(field, entry, bool):
                found.append(Constraint(field, pb.StructuredOutputs(json_object=True)))
        elif key in _UNSUPPORTED:
            raise _invalid(field, "is not supported by this server")
        elif key not in _NEUTRAL_OPTIONS:
            raise _invalid("structured_outputs", f"unknown field {shown(str(key), 40)}")
        elif not _NEUTRAL_OPTIONS[key](entry):
            raise _invalid(field, "is not supported by this server (only its neutral value is accepted)")
    return found


def _constraint(field: str, kind: str, value: object) -> Constraint:
    """kind: json (a JSON Schema, as an object or its text), regex or choice."""
    if kind == "json":
        if isinstance(value, dict):
            value = _dumps(field, value)
        elif not isinstance(value, str):
            raise _invalid(field, f"must be a JSON Schema (an object, or its JSON text), got {json_kind(value)}")
        return Constraint(field, pb.StructuredOutputs(json_schema=value))
    if kind == "regex":
        return Constraint(field, pb.StructuredOutputs(regex=_typed(field, value, str)))
    if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
        raise _invalid(field, f"must be an array of strings, got {json_kind(value)}")
    return Constraint(field, pb.StructuredOutputs(choice=pb.StringChoices(choices=value)))


def _typed(field: str, value: object, kind: type) -> Any:
    if not isinstance(value, kind):
        raise _invalid(field, f"must be {'a string' if kind is str else 'a boolean'}, got {json_kind(value)}")
    return value


def _dumps(field: str, schema: dict[str, Any]) -> str:
    # Key order kept: a grammar lays an object's properties out in the schema's order.
    try:
        return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
    except (RecursionError, ValueError) as e:
        raise _invalid(field, "is nested too deeply") from e
