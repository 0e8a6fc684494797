"""Grammar libraries for structured outputs, side by side on the default model's tokenizer.

Measures whichever of xgrammar, llguidance and outlines-core can be imported: the one-off cost
of wrapping the tokenizer, the compile time of three grammars (a nested JSON Schema with
objects, arrays, enums and bounded integers; any JSON object; a regex), and, walking the
tokens of a valid output of each, the time per token to fill the packed allowed-token bitmask
and to accept the token. Prints a table and each library's mask + accept time as a share of
the per-token decode budget (--budget-ms; default: the README's 12.4 ms a token of a lone
stream through the whole serving path on CPU), and its ratio to the fastest library.

Candidates that are not installed are skipped; to measure them without touching the venv,
install them elsewhere and put that folder on PYTHONPATH, e.g.
``pip install --no-deps --target /tmp/glibs/xgrammar xgrammar apache-tvm-ffi``.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

logger = logging.getLogger(__name__)

CANDIDATES = ("xgrammar", "llguidance", "outlines_core")

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "name": {"type": "string", "maxLength": 40},
        "status": {"enum": ["active", "suspended", "closed"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
        "orders": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 100},
                    "price": {"type": "number"},
                },
                "required": ["sku", "quantity", "price"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["id", "name", "status", "tags", "address", "orders"],
    "additionalProperties": False,
}
SCHEMA_DOC = {
    "id": 48213, "name": "Ada Lovelace", "status": "active", "tags": ["math", "engines", "poetry"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "10001"},
    "orders": [{"sku": "AE-1843", "quantity": 2, "price": 19.99}, {"sku": "NOTE-G", "quantity": 1, "price": 4.5}],
}
OBJECT_DOC = {"question": "What is the capital of France?", "answer": "Paris", "confidence": 0.97,
              "sources": ["encyclopedia", "atlas"], "meta": {"lang": "en", "reviewed": True, "notes": None}}
REGEX = (r"(Mon|Tue|Wed|Thu|Fri|Sat|Sun), [0-9]{2} (Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec) [0-9]{4} "
         r"[0-9]{2}:[0-9]{2}:[0-9]{2} GMT; [a-z0-9._]+@[a-z0-9]+\.(com|org|net)")
REGEX_DOC = "Tue, 14 Mar 2023 09:26:53 GMT; ada.lovelace@example.org"


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "json" (schema text), "json_object" or "regex"
    text: str
    output: str  # a valid output: its tokens are walked


CASES = (
    Case("json_schema", "json", json.dumps(SCHEMA), json.dumps(SCHEMA_DOC)),
    Case("json_object", "json_object", "", json.dumps(OBJECT_DOC)),
    Case("regex", "regex", REGEX, REGEX_DOC),
)


class Candidate:
    """One library behind a common face: compile, start a matcher, fill its mask, accept."""

    name = ""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: list[int]) -> None:
        self.vocab_size = vocab_size

    def compile(self, case: Case) -> Any:
        raise NotImplementedError

    def matcher(self, compiled: Any) -> Any:
        raise NotImplementedError

    def fill(self, matcher: Any, bitmask: np.ndarray) -> None:
        """Writes row 0 of the int32 ``bitmask`` ``[1, ceil(vocab / 32)]``."""
        raise NotImplementedError

    def accept(self, matcher: Any, token: int) -> bool:
        raise NotImplementedError


class XGrammar(Candidate):
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: list[int]) -> None:
        import xgrammar

        super().__init__(tokenizer, vocab_size, eos_ids)
        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos_ids)
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, case: Case) -> Any:
        if case.kind == "json":
            return self.compiler.compile_json_schema(case.text)
        if case.kind == "json_object":
            return self.compiler.compile_builtin_json_grammar()
        return self.compiler.compile_regex(case.text)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, bitmask: np.ndarray) -> None:
        import torch

        matcher.fill_next_token_bitmask(torch.from_numpy(bitmask))

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)


class LLGuidance(Candidate):
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: list[int]) -> None:
        import llguidance

        super().__init__(tokenizer, vocab_size, eos_ids)
        self.llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(tokenizer.backend_tokenizer.to_str(), n_vocab=vocab_size,
                                                eos_token=eos_ids)

    def compile(self, case: Case) -> Any:
        m = self.llg.LLMatcher
        text = '{"type": "object"}' if case.kind == "json_object" else case.text
        grammar = m.grammar_from_regex(text) if case.kind == "regex" else m.grammar_from_json_schema(text)
        template = m(self.tokenizer, grammar, log_level=0)
        assert not template.is_error(), template.get_error()
        return template

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, matcher: Any, bitmask: np.ndarray) -> None:
        matcher.unsafe_compute_mask_ptr(bitmask.ctypes.data, bitmask.nbytes)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)


class OutlinesCore(Candidate):
    name = "outlines_core"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: list[int]) -> None:
        import outlines_core

        super().__init__(tokenizer, vocab_size, eos_ids)
        self.oc = outlines_core
        self.vocabulary = outlines_core.Vocabulary(eos_ids[0], byte_level_vocabulary(tokenizer, eos_ids))

    def compile(self, case: Case) -> Any:
        if case.kind == "regex":
            regex = case.text
        else:
            text = '{"type": "object"}' if case.kind == "json_object" else case.text
            regex = self.oc.json_schema.build_regex_from_schema(text)
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def fill(self, matcher: Any, bitmask: np.ndarray) -> None:
        matcher.write_mask_into(bitmask.ctypes.data, bitmask.size, 4)

    def accept(self, matcher: Any, token: int) -> bool:
        if not matcher.accepts_tokens([token]):
            return False
        matcher.advance(token, return_tokens=False)
        return True


BACKENDS: dict[str, Callable[..., Candidate]] = {"xgrammar": XGrammar, "llguidance": LLGuidance,
                                                 "outlines_core": OutlinesCore}


def byte_level_vocabulary(tokenizer: Any, eos_ids: list[int]) -> dict[bytes, list[int]]:
    """A byte-level BPE vocabulary as outlines-core wants it: each token's bytes -> its ids."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    to_byte = {c: b for b, c in bytes_to_unicode().items()}
    special = set(tokenizer.all_special_ids) | set(eos_ids)
    vocabulary: dict[bytes, list[int]] = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token_id in special or not all(c in to_byte for c in token):
            continue
        vocabulary.setdefault(bytes(to_byte[c] for c in token), []).append(token_id)
    return vocabulary


@dataclass
class Result:
    name: str
    version: str
    setup_ms: float = 0.0
    compile_ms: dict[str, float] = field(default_factory=dict)
    mask_us: dict[str, list[float]] = field(default_factory=dict)
    """Per token position, the least over the walks after the first (a noisy machine's
    preemptions drop out; a position that is dear in every walk stays dear)."""
    first_mask_us: dict[str, list[float]] = field(default_factory=dict)
    """Per token position, the first walk (lazy caches fill then)."""
    accept_us: dict[str, list[float]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


def measure(backend: str, tokenizer: Any, vocab_size: int, eos_ids: list[int], repeats: int) -> Result:
    """One library: setup, compile (median of ``repeats``), and per-token mask and accept times."""
    result = Result(backend, importlib.metadata.version(backend.replace("_", "-")))
    start = time.perf_counter()
    candidate = BACKENDS[backend](tokenizer, vocab_size, eos_ids)
    result.setup_ms = (time.perf_counter() - start) * 1e3
    bitmask = np.zeros((1, (vocab_size + 31) // 32), dtype=np.int32)
    for case in CASES:
        tokens = tokenizer.encode(case.output, add_special_tokens=False)
        try:
            compile_s = []
            for _ in range(repeats):
                start = time.perf_counter()
                compiled = candidate.compile(case)
                compile_s.append(time.perf_counter() - start)
            mask_s, accept_s = np.zeros((repeats + 1, len(tokens))), np.zeros((repeats + 1, len(tokens)))
            for walk in range(repeats + 1):
                matcher = candidate.matcher(compiled)
                for i, token in enumerate(tokens):
                    t0 = time.perf_counter()
                    candidate.fill(matcher, bitmask)
                    t1 = time.perf_counter()
                    if not (bitmask[0, token // 32] >> (token % 32)) & 1 or not candidate.accept(matcher, token):
                        raise RuntimeError(f"refused token {token} ({tokenizer.decode([token])!r}) of a valid output")
                    accept_s[walk, i], mask_s[walk, i] = time.perf_counter() - t1, t1 - t0
        except Exception as e:  # a candidate that cannot do a case is reported, not fatal
            result.errors[case.name] = f"{type(e).__name__}: {str(e)[:120]}"
            logger.warning("%s: %s: %s", backend, case.name, result.errors[case.name])
            continue
        result.compile_ms[case.name] = statistics.median(compile_s) * 1e3
        result.first_mask_us[case.name] = (mask_s[0] * 1e6).tolist()
        result.mask_us[case.name] = (mask_s[1:].min(axis=0) * 1e6).tolist()
        result.accept_us[case.name] = (accept_s[1:].min(axis=0) * 1e6).tolist()
    return result


def print_table(results: list[Result], budget_ms: float) -> None:
    print(f"{'library':<14} {'version':<8} {'case':<12} {'compile ms':>10} {'mask us p50':>11} {'mean':>8} "
          f"{'max':>8} {'1st walk':>8} {'accept us':>9} {'% budget':>8}")
    for r in results:
        print(f"{r.name:<14} {r.version:<8} {'(tokenizer)':<12} {r.setup_ms:>10.1f}")
        for case in CASES:
            if case.name in r.errors:
                print(f"{r.name:<14} {r.version:<8} {case.name:<12} {r.errors[case.name]}")
                continue
            mask, accept = r.mask_us[case.name], r.accept_us[case.name]
            per_token = statistics.fmean(mask) + statistics.fmean(accept)
            print(f"{r.name:<14} {r.version:<8} {case.name:<12} {r.compile_ms[case.name]:>10.2f} "
                  f"{statistics.median(mask):>11.1f} {statistics.fmean(mask):>8.1f} {max(mask):>8.1f} "
                  f"{statistics.fmean(r.first_mask_us[case.name]):>8.1f} "
                  f"{statistics.fmean(accept):>9.1f} {100 * per_token / (budget_ms * 1e3):>7.2f}%")
    complete = [r for r in results if not r.errors]
    if len(complete) < 2:
        return
    overall = {r.name: statistics.fmean([statistics.fmean(r.mask_us[c.name]) + statistics.fmean(r.accept_us[c.name])
                                         for c in CASES]) for r in complete}
    best = min(overall.values())
    print(f"\nmask + accept per token, mean over the cases (budget {budget_ms} ms a token):")
    for name, us in sorted(overall.items(), key=lambda kv: kv[1]):
        print(f"  {name:<14} {us:8.1f} us  {us / best:5.2f}x the fastest  "
              f"{100 * us / (budget_ms * 1e3):5.2f}% of budget")


def add_args(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--model", default=None, help="local HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    a("--libraries", nargs="*", default=list(CANDIDATES), choices=CANDIDATES)
    a("--repeats", type=int, default=5, help="compiles and walks of each case")
    a("--budget-ms", type=float, default=12.4, help="per-token decode budget the overhead is compared with")
    a("--quick", action="store_true", help="one repeat")


def run(args: argparse.Namespace) -> int:
    import importlib.util

    from tandem.model.gguf_cache import cached_source
    from tandem.model.source import load_tokenizer, resolve_model_source

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    tokenizer = load_tokenizer(cached_source(resolve_model_source(args.model)))
    vocab_size, eos_ids = len(tokenizer), [tokenizer.eos_token_id]
    available = [n for n in args.libraries if importlib.util.find_spec(n) is not None]
    for name in sorted(set(args.libraries) - set(available)):
        logger.info("%s is not installed: skipped", name)
    if not available:
        print("none of the candidate libraries is installed")
        return 1
    repeats = 1 if args.quick else args.repeats
    results = [measure(name, tokenizer, vocab_size, eos_ids, repeats) for name in available]
    print(f"\nvocab {vocab_size}, {repeats} repeats; token counts: "
          + ", ".join(f"{c.name} {len(tokenizer.encode(c.output, add_special_tokens=False))}" for c in CASES))
    print_table(results, args.budget_ms)
    return 0
