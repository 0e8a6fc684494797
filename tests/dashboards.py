"""Reading Grafana dashboards and the PromQL in them (stdlib only).

`dashboard_queries(path)` lists every target expression of a dashboard; `metric_names_in(expr)`
names the metrics one expression reads; `vector_selectors(expr)` gives each metric with its
label matchers. The tests compare those names with docs/metrics.md, and with what a live
router's /metrics serves.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

# PromQL words that are not metric names: aggregation operators, set and comparison keywords,
# the `offset` / `@` modifiers, and the float literals Inf and NaN. Functions need no list: an
# identifier followed by "(" is a function call (or an aggregation), never a metric.
AGGREGATIONS = {
    "sum", "avg", "count", "min", "max", "stddev", "stdvar", "topk", "bottomk", "quantile",
    "count_values", "group", "limitk", "limit_ratio",
}
KEYWORDS = AGGREGATIONS | {"and", "or", "unless", "bool", "offset", "atan2", "start", "end", "inf", "nan"}
# Keywords whose parenthesised list holds label names, not metrics.
LABEL_LIST_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right"}

_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<comment>\#[^\n]*)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<variable>\$\{[^}]*\}|\$\w+|\[\[[\w:.]+\]\])       # Grafana: ${x}, $x, $__rate_interval, [[x]]
  | (?P<duration>(?:\d+(?:ms|[smhdwy]))+(?!\w))
  | (?P<number>0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<punct>[(){}\[\],]|[^\s\w"'`$(){}\[\],]+)
""", re.VERBOSE)


def dashboard_queries(path: str | Path) -> list[str]:
    """Every target expression of the dashboard at `path`, rows' nested panels included."""
    dashboard = json.loads(Path(path).read_text())
    return [target["expr"] for panel in iter_panels(dashboard)
            for target in panel.get("targets", []) if target.get("expr")]


def iter_panels(dashboard: dict) -> Iterator[dict]:
    """Every panel, depth first: a collapsed row keeps its panels in its own `panels` list."""
    stack = list(reversed(dashboard.get("panels", [])))
    while stack:
        panel = stack.pop()
        yield panel
        stack.extend(reversed(panel.get("panels", [])))


def metric_names_in(expr: str) -> set[str]:
    """The Prometheus metric names that the PromQL expression `expr` reads."""
    return {name for name, _ in vector_selectors(expr)}


def vector_selectors(expr: str) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """Each metric the expression reads, in order, with its label matchers as (label, op, value).

    `{__name__="x", ...}` counts as metric x; a selector with no equality on __name__ (a
    regex over names) is left out, since it names no single metric.
    """
    tokens = _tokenize(expr)
    found: list[tuple[str, list[tuple[str, str, str]]]] = []
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        nxt = tokens[i + 1][1] if i + 1 < len(tokens) else None
        if kind == "punct" and text == "{":  # a selector with no metric name before it
            end = _closing(tokens, i)
            matchers = _matchers(tokens[i + 1:end])
            names = [value for label, op, value in matchers if label == "__name__" and op == "="]
            if names:
                found.append((names[0], [m for m in matchers if m[0] != "__name__"]))
            i = end + 1
        elif kind == "punct" and text == "[":  # range or subquery: durations only
            i = _closing(tokens, i) + 1
        elif kind == "ident" and text.lower() in LABEL_LIST_KEYWORDS:
            i = _closing(tokens, i + 1) + 1 if nxt == "(" else i + 1
        elif kind == "ident" and text.lower() not in KEYWORDS and nxt != "(":
            if nxt == "{":
                end = _closing(tokens, i + 1)
                found.append((text, _matchers(tokens[i + 2:end])))
                i = end + 1
            else:
                found.append((text, []))
                i += 1
        else:
            i += 1
    return found


def _tokenize(expr: str) -> list[tuple[str, str]]:
    tokens = []
    for m in _TOKEN.finditer(expr):
        if m.lastgroup is not None and m.lastgroup not in ("space", "comment"):
            tokens.append((m.lastgroup, m.group()))
    return tokens


def _closing(tokens: list[tuple[str, str]], start: int) -> int:
    """Index of the bracket closing the one at `start` (the last token when unbalanced)."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    opening = tokens[start][1]
    depth = 0
    for j in range(start, len(tokens)):
        if tokens[j][0] != "punct":
            continue
        if tokens[j][1] == opening:
            depth += 1
        elif tokens[j][1] == pairs[opening]:
            depth -= 1
            if depth == 0:
                return j
    return len(tokens) - 1


def _matchers(tokens: list[tuple[str, str]]) -> list[tuple[str, str, str]]:
    """`label op "value"` triples from the tokens between a selector's braces."""
    out = []
    for j in range(len(tokens) - 2):
        (k1, label), (k2, op), (k3, value) = tokens[j:j + 3]
        if k1 == "ident" and k2 == "punct" and op in ("=", "!=", "=~", "!~") and k3 == "string":
            out.append((label, op, _unquote(value)))
    return out


def _unquote(literal: str) -> str:
    if literal.startswith("`"):
        return literal[1:-1]
    return re.sub(r"\\(.)", r"\1", literal[1:-1])
