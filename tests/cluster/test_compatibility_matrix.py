"""Disaggregated equals colocated, as a matrix (compat_matrix.py: features × mode · transport).

Each cell sends the same requests (fixed seeds where sampled) to a disaggregated cluster over
one KV transport (or to its decode workers alone: local) and to the colocated reference, one
colocated worker with the same weights and engine options, and asserts the outputs are equal
token for token (log-probabilities within 1e-3); that the KV took the column's path; and
that the feature really ran (a prefix-cache hit on the side named, drafts accepted, blocks
swapped, sequences preempted). Each cell's result goes to a JSON file (compat_matrix.RESULTS_ENV),
from which docs/compatibility.md is written; the last test checks the committed doc against
the matrix, so that neither drifts.

Clusters, started one at a time in this order (each cell runs on the one its feature needs):
the session's float32 cluster (shm) and its local router; float32 over zmq and gloo; int8
weights with a tp=2 prefill worker, speculation and swap preemption on a 5-block pool, over
each transport; int4 weights with a tp=2 decode worker and recompute preemption, likewise.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from compat_clusters import DEPLOYMENTS, FEATURE_SETTING, PATH_OF, Matrix, deployment_of
from compat_matrix import (
    COLUMNS,
    DIFFERS,
    DOC,
    FAIL,
    FEATURES,
    PASS,
    TESTED,
    cell_id,
    is_known,
    parse_table,
    runnable_cells,
    static_cells,
)
from compat_requests import Call, Outcome, first_difference, serve
from metrics_text import parse_samples, total
from reference import english_token_ids
from running_cluster import RunningCluster
from worker_checks import assert_workers_empty

from tandem import SamplingParams
from tandem.router.ray_backend import RayBackend
from tandem.structured_outputs import StructuredOutputsParams

CASES = sorted(runnable_cells(), key=lambda fc: DEPLOYMENTS.index(deployment_of(*fc)))
"""Grouped by cluster: each starts once, when its first cell runs, and stops before the next starts."""
PARAMS = [pytest.param(f, c, id=cell_id(f, c)) for f, c in CASES]


@pytest.fixture(scope="module")
def matrix(clusters) -> Iterator[Matrix]:
    m = Matrix(clusters)
    try:
        yield m
    finally:
        m.close()
        m.write()


@dataclass
class Cell:
    feature: str
    column: str
    matrix: Matrix
    cluster: RunningCluster
    """Serves the column: the disaggregated cluster's router, or its local one."""
    reference: RunningCluster
    tokenizer: Any

    def prompt(self, n: int, skip: int) -> list[int]:
        return english_token_ids(self.tokenizer, n, skip=skip)

    def unique_skip(self) -> int:
        """An offset into the reference text of this cell's own (prefix cells: no other cell's prompt)."""
        return 1500 + 60 * [c.key for c in COLUMNS].index(self.column) + 30 * FEATURE_SETTING_ORDER[self.feature]

    def expect(self, calls: list[Call]) -> list[Outcome]:
        key = (FEATURE_SETTING[self.feature], repr(calls))
        if key not in self.matrix.expected:
            self.matrix.expected[key] = serve(self.reference, calls)
        return self.matrix.expected[key]

    def check(self, calls: list[Call], got: list[Outcome]) -> None:
        difference = first_difference(got, self.expect(calls), calls)
        assert difference is None, difference

    def run(self, calls: list[Call], backend: RayBackend | None = None, at_once: bool = False) -> list[Outcome]:
        got = serve(self.cluster, calls, backend, at_once)
        self.check(calls, got)
        return got

    def counter(self, name: str, **labels: str) -> float:
        return total(parse_samples(self.cluster.scrape()), name, **labels)

    def paths(self) -> dict[str, float]:
        samples = parse_samples(self.cluster.scrape())
        return {p: total(samples, "tandem_kv_transfer_paths_total", role="prefill", path=p)
                for p in ("shm", "zmq", "dist", "nccl", "cuda_ipc")}


FEATURE_SETTING_ORDER = {f.key: i for i, f in enumerate(FEATURES)}
GREEDY8 = SamplingParams(temperature=0, max_tokens=8)


def probe_set(cell: Cell) -> None:
    """What the weights and tensor-parallel rows send: greedy on 5 and 40 tokens (the latter
    chunked under a 32-token budget), and two sampled completions."""
    cell.run([(cell.prompt(5, 0), GREEDY8), (cell.prompt(40, 41), GREEDY8),
              (cell.prompt(24, 300), SamplingParams(temperature=0.8, seed=21, n=2, max_tokens=6))], at_once=True)


def greedy(cell: Cell) -> None:
    cell.run([(cell.prompt(n, 41 * i), GREEDY8) for i, n in enumerate((5, 40, 300))])


def seeded(cell: Cell) -> None:
    cell.run([(cell.prompt(30, 200), SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=7, max_tokens=8))])


def parallel_sampling(cell: Cell) -> None:
    cell.run([(cell.prompt(25, 250), SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=6))])


def beam(cell: Cell) -> None:
    cell.run([(cell.prompt(20, 350), SamplingParams(temperature=0, use_beam_search=True, beam_width=3, n=2,
                                                    max_tokens=6))])


PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def structured(cell: Cell) -> None:
    tok = cell.tokenizer
    chat = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": 'Return a JSON object with keys "name" and "age" for Alice, 30.'}],
        tokenize=False, add_generation_prompt=True))
    constraint = StructuredOutputsParams(json=json.dumps(PERSON))
    got = cell.run([(chat, SamplingParams(temperature=0, max_tokens=40, structured_outputs=constraint)),
                    (chat, SamplingParams(temperature=1.0, seed=5, max_tokens=40, structured_outputs=constraint))])
    for (ids, _, _), in got:  # the constraint held (so the grammar ran on both sides)
        value = json.loads(tok.decode(ids, skip_special_tokens=True))
        assert set(value) == {"name", "age"}, value


def logprobs(cell: Cell) -> None:
    got = cell.run([(cell.prompt(19, 700), SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=5,
                                                          ignore_eos=True, logprobs=5))])
    assert all(tops is not None and len(tops) == 5 for (_, _, tops) in got[0])


def prefix_decode(cell: Cell) -> None:
    """The decode worker caches the prompt (it prefilled it alone), the prefill worker does not."""
    first, more = cell.prompt(40, cell.unique_skip()), cell.prompt(12, cell.unique_skip() + 400)
    local = cell.matrix.subset(cell.cluster, (0,), (0,), "never")
    disaggregated = local if cell.column == "local" else cell.matrix.subset(cell.cluster, (0,), (0,), "always")
    decode = cell.cluster.backend.decode[0].instance
    cell.run([(first, SamplingParams(temperature=0, max_tokens=6))], local)
    hits = cell.counter("tandem_prefix_cache_hits_total", role="decode", instance=decode)
    prefill_hits = cell.counter("tandem_prefix_cache_hits_total", role="prefill")
    cell.run([(first + more, SamplingParams(temperature=0, max_tokens=6))], disaggregated)
    assert cell.counter("tandem_prefix_cache_hits_total", role="decode", instance=decode) - hits >= 32
    assert cell.counter("tandem_prefix_cache_hits_total", role="prefill") == prefill_hits


def prefix_prefill(cell: Cell) -> None:
    """The prefill worker caches the prompt (it sent it to decode worker 0); decode worker 1 does not."""
    first, more = cell.prompt(40, cell.unique_skip()), cell.prompt(12, cell.unique_skip() + 400)
    decode1 = cell.cluster.backend.decode[1].instance
    cell.run([(first, SamplingParams(temperature=0, max_tokens=6))], cell.matrix.subset(cell.cluster, (0,), (0,),
                                                                                        "always"))
    hits = cell.counter("tandem_prefix_cache_hits_total", role="prefill")
    decode_hits = cell.counter("tandem_prefix_cache_hits_total", role="decode", instance=decode1)
    cell.run([(first + more, SamplingParams(temperature=0, max_tokens=6))],
             cell.matrix.subset(cell.cluster, (0,), (1,), "always"))
    assert cell.counter("tandem_prefix_cache_hits_total", role="prefill") - hits >= 32
    assert cell.counter("tandem_prefix_cache_hits_total", role="decode", instance=decode1) == decode_hits


def spec(cell: Cell) -> None:
    tok = cell.tokenizer
    passage = tok.decode(cell.prompt(20, 40))
    prompt = tok.encode(f"{passage}\n\nRepeat the text above exactly:\n\n{passage[:30]}")
    accepted = cell.counter("tandem_spec_decode_num_accepted_tokens_total", role="decode")
    cell.run([(prompt, SamplingParams(temperature=0, max_tokens=16))])
    assert cell.counter("tandem_spec_decode_num_accepted_tokens_total", role="decode") > accepted, "no draft accepted"


def preemption_batch(cell: Cell) -> None:
    """Four requests at once: greedy and seeded, 20 + 56 tokens (5 blocks at full length, the
    whole pool), and a greedy and a seeded n=2, 20 + 44 tokens (4 blocks a fork, 7 for both with
    the prompt's shared one: its forks preempt each other too). Outputs this long let a request
    that reaches the decode worker a prefill step after another still overlap it (with 28 tokens,
    a decode worker whose steps outran the prefill worker's saw them one at a time, and nothing
    was preempted)."""
    params = [SamplingParams(temperature=0, max_tokens=56, ignore_eos=True),
              SamplingParams(temperature=0, n=2, max_tokens=44, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=2, max_tokens=56, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=44, ignore_eos=True)]
    cell.run([(cell.prompt(20, 60 + 97 * i), p) for i, p in enumerate(params)], at_once=True)


def swap(cell: Cell) -> None:
    swapped = cell.counter("tandem_num_swapped_out_blocks_total", role="decode")
    preemption_batch(cell)
    assert cell.counter("tandem_num_swapped_out_blocks_total", role="decode") > swapped, "nothing swapped out"


def recompute(cell: Cell) -> None:
    swapped = cell.counter("tandem_num_swapped_out_blocks_total", role="decode")
    preempted = cell.counter("tandem_num_preemptions_total", role="decode")
    preemption_batch(cell)
    assert cell.counter("tandem_num_preemptions_total", role="decode") > preempted, "nothing preempted"
    assert cell.counter("tandem_num_swapped_out_blocks_total", role="decode") == swapped


CHECKS: dict[str, Callable[[Cell], None]] = {
    "greedy": greedy, "seeded": seeded, "n": parallel_sampling, "beam": beam, "structured": structured,
    "logprobs": logprobs, "prefix_decode": prefix_decode, "prefix_prefill": prefix_prefill, "spec": spec,
    "swap": swap, "recompute": recompute, "float": probe_set, "int8": probe_set, "int4": probe_set,
    "tp_prefill": probe_set, "tp_decode": probe_set,
}


@pytest.mark.slow
@pytest.mark.parametrize(("feature", "column"), PARAMS)
def test_disaggregated_equals_colocated(matrix: Matrix, tokenizer, feature: str, column: str) -> None:
    name = deployment_of(feature, column)
    running = matrix.deployment(name)
    reference = matrix.reference(FEATURE_SETTING[feature])
    served_by = running["local" if column == "local" else "disaggregated"]
    cell = Cell(feature, column, matrix, served_by, reference, tokenizer)
    try:
        before = cell.paths()
        CHECKS[feature](cell)
        moved = {p: n - before[p] for p, n in cell.paths().items()}
        want = {p: 0.0 for p in moved}
        if column != "local":
            want[PATH_OF[column]] = moved[PATH_OF[column]]
            assert moved[PATH_OF[column]] > 0, f"no KV over {PATH_OF[column]}: {moved}"
        assert moved == want, f"the KV took other paths: {moved}"
        assert_workers_empty(served_by)
    except Exception as e:
        detail = str(e).splitlines()[0] if str(e) else ""
        matrix.record(feature, column, FAIL, name, detail if isinstance(e, AssertionError)
                      else f"{type(e).__name__}: {detail}")
        raise
    matrix.record(feature, column, PASS, name)


def test_the_committed_doc_matches_the_matrix() -> None:
    """docs/compatibility.md has exactly the matrix's features and columns, every cell known:
    tested (✓), differing (✗), not applicable or not run for want of a GPU, with its reason."""
    columns, features, cells = parse_table(DOC.read_text())
    assert columns == [c.label for c in COLUMNS]
    assert features == [f.label for f in FEATURES]
    static = static_cells()
    label = {f.key: f.label for f in FEATURES} | {c.key: c.label for c in COLUMNS}
    unknown = {k: t for k, t in cells.items() if not is_known(t)}
    assert not unknown, unknown
    for f in FEATURES:
        for c in COLUMNS:
            text = cells[f.label, c.label]
            if (f.key, c.key) in static:
                assert text == static[f.key, c.key].replace("|", "\\|"), (f.key, c.key)
            else:
                assert text.startswith((TESTED, DIFFERS)), (label[f.key], label[c.key], text)
    assert sorted(CASES) == sorted(runnable_cells())
