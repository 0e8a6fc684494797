"""The compatibility matrix of disaggregated serving: its features (rows), its columns (how a
request is served: mode and KV transport), the cells no CPU run can fill (with the reason),
and docs/compatibility.md rendered from a run's results and read back.

Torch-free. tests/cluster/test_compatibility_matrix.py runs the cells and writes the results
(JSON); this module renders them:

    .venv/bin/python tests/cluster/compat_matrix.py --results build/compatibility-results.json \
        --write docs/compatibility.md
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "compatibility.md"
DEFAULT_RESULTS = Path(__file__).resolve().parents[2] / "build" / "compatibility-results.json"
RESULTS_ENV = "TANDEM_COMPAT_RESULTS"
"""Where the test writes its results (default: DEFAULT_RESULTS)."""
DOC_ENV = "TANDEM_COMPAT_DOC"
"""When set, the test also renders the doc there at the end of its module."""

PASS, FAIL = "pass", "fail"
TESTED = "✓"
DIFFERS = "✗"
NOT_APPLICABLE = "n/a"
NEEDS_GPU = "needs GPU"


@dataclass(frozen=True)
class Feature:
    key: str
    label: str
    how: str
    """What the cell sends (for the doc's notes)."""


@dataclass(frozen=True)
class Column:
    key: str
    mode: str
    transport: str

    @property
    def label(self) -> str:
        return f"{self.mode} · {self.transport}"


FEATURES: tuple[Feature, ...] = (
    Feature("greedy", "greedy", "temperature 0, prompts of 5, 40 and 300 tokens (300: chunked prefill)"),
    Feature("seeded", "seeded sampling", "temperature 0.8, top_p 0.9, top_k 50, seed 7"),
    Feature("n", "n > 1", "n = 3 sampled completions (seed 11: completion i uses seed 11 + i)"),
    Feature("beam", "beam search", "beam_width 3, n = 2"),
    Feature("structured", "structured outputs", "a JSON schema, greedy and sampled (seed 5), chat prompt"),
    Feature("logprobs", "top logprobs", "logprobs = 5, n = 2 sampled: ids exact, log-probabilities within 1e-3"),
    Feature("prefix_decode", "prefix hit on the decode side",
            "a prompt prefilled on one decode worker alone (local), then that prompt + 12 tokens "
            "disaggregated to it: the decode worker's cache hits, only the rest of the KV travels"),
    Feature("prefix_prefill", "prefix hit on the prefill side",
            "a prompt served disaggregated by decode worker 1, then that prompt + 12 tokens by decode "
            "worker 2: the prefill worker's cache hits, the decode worker's misses"),
    Feature("spec", "prompt-lookup speculation", "num_speculative_tokens 4, a prompt the output copies: "
            "drafts accepted on the decode worker"),
    Feature("swap", "swap preemption", "4 requests at once (2 greedy, 2 seeded) on a 5-block pool, "
            "preemption_mode swap: blocks swapped out"),
    Feature("recompute", "recompute preemption", "the same, preemption_mode recompute: sequences preempted, "
            "nothing swapped"),
    Feature("float", "float32 weights", "the probe set (greedy on 5 and 40 tokens, n = 2 sampled)"),
    Feature("int8", "int8 weights", "the probe set, quantization int8 (per output channel)"),
    Feature("int4", "int4 weights", "the probe set, quantization int4 (the GGUF's Q4_1 blocks)"),
    Feature("tp_prefill", "prefill tp=2, decode tp=1", "the probe set, the prefill worker on 2 ranks (gloo)"),
    Feature("tp_decode", "prefill tp=1, decode tp=2",
            "the probe set, the decode worker on 2 ranks (gloo); the KV mapped onto the ranks' head shards"),
)

COLUMNS: tuple[Column, ...] = (
    Column("shm", "disaggregated", "shm"),
    Column("zmq", "disaggregated", "zmq"),
    Column("gloo", "disaggregated", "gloo"),
    Column("nccl", "disaggregated", "nccl"),
    Column("cuda_ipc", "disaggregated", "cuda_ipc"),
    Column("local", "local", "none"),
)

_GPU_WHY = {
    "nccl": "NCCL pairs move KV between two GPUs; this run had none",
    "cuda_ipc": "CUDA IPC writes into a decode pool on the same GPU; this run had none",
}
_LOCAL_WHY = {
    "prefix_prefill": "a local request never reaches a prefill worker",
    "tp_prefill": "a local request never reaches the (tp=2) prefill worker",
    "tp_decode": "the local router runs over the shm cluster, whose decode worker is at tp=1 (see the shm cell)",
}
_OTHER = {
    ("tp_decode", "shm"): "auto writes in place only into a tp=1 decode worker's pool (shared memory); a tp=2 "
                          "decode worker's is per rank, so auto sends it ZMQ frames: the zmq column",
}


def static_cells() -> dict[tuple[str, str], str]:
    """The cells no CPU run fills, by (feature key, column key): their text in the doc."""
    cells: dict[tuple[str, str], str] = {}
    for f in FEATURES:
        for column, why in _GPU_WHY.items():
            cells[f.key, column] = f"{NEEDS_GPU}: not run here ({why})"
        if f.key in _LOCAL_WHY:
            cells[f.key, "local"] = f"{NOT_APPLICABLE}: {_LOCAL_WHY[f.key]}"
    cells.update({k: f"{NOT_APPLICABLE}: {why}" for k, why in _OTHER.items()})
    return cells


def runnable_cells() -> list[tuple[str, str]]:
    """Every other cell: each one a test case."""
    static = static_cells()
    return [(f.key, c.key) for f in FEATURES for c in COLUMNS if (f.key, c.key) not in static]


def cell_id(feature: str, column: str) -> str:
    return f"{feature}|{column}"


def cell_text(feature: str, column: str, results: Mapping[str, Mapping[str, str]], date: str) -> str:
    static = static_cells().get((feature, column))
    if static is not None:
        return static
    result = results.get(cell_id(feature, column))
    if result is None:
        raise ValueError(f"no result for {feature} × {column}: run every cell before writing the doc")
    if result["status"] == PASS:
        return f"{TESTED} {result.get('deployment', '')}".rstrip()
    return f"{DIFFERS} {_one_line(result.get('detail', ''))}"


def _one_line(text: str, limit: int = 200) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= limit else text[:limit - 1] + "…"


def render(results: Mapping[str, Mapping[str, str]], date: str, deployments: Mapping[str, str]) -> str:
    """docs/compatibility.md from one run's results (every runnable cell given)."""
    head = "| feature | " + " | ".join(c.label for c in COLUMNS) + " |"
    rule = "| --- |" + " --- |" * len(COLUMNS)
    rows = [f"| {f.label} | " + " | ".join(cell_text(f.key, c.key, results, date) for c in COLUMNS) + " |"
            for f in FEATURES]
    failed = [(f, c) for f in FEATURES for c in COLUMNS
              if results.get(cell_id(f.key, c.key), {}).get("status") == FAIL]
    lines = [
        "# Compatibility: disaggregated equals colocated",
        "",
        "Generated by `tests/cluster/test_compatibility_matrix.py` (then `tests/cluster/compat_matrix.py "
        "--write`); do not edit by hand: `test_the_committed_doc_matches_the_matrix` fails when this table "
        "and the test's lists of features and columns drift apart.",
        "",
        f"Each cell sends the same requests (a fixed seed where sampled) to a disaggregated cluster and to "
        f"the colocated reference (one colocated worker with the same weights and engine options) and "
        f"asserts the outputs are equal token for token (and log-probabilities within 1e-3 where asked "
        f"for), and that the KV took the column's path (`tandem_kv_transfer_paths_total`; none for "
        f"`local`) and the feature really ran (a prefix-cache hit, accepted drafts, a swap, a preemption). "
        f"{TESTED}: equal in the run of {date} (the cluster it ran on after the mark); {DIFFERS}: differs "
        f"(the first differing token given); {NOT_APPLICABLE}: the feature cannot be expressed there; "
        f"{NEEDS_GPU}: not run on this CPU-only machine, so not known to work.",
        "",
        "Columns: `disaggregated · T` is a prompt prefilled on the prefill pool, its KV moved to the decode "
        "worker over transport T (`shm`: `--kv-transport auto` on one node, written in place into the decode "
        "worker's pool in shared memory; `zmq`: ZMQ frames; `gloo`: a torch.distributed pair; `nccl`, "
        "`cuda_ipc`: the GPU paths). `local · none` is `--disagg-policy never`: the decode worker prefills "
        "the prompt itself, no KV moves.",
        "",
        head,
        rule,
        *rows,
        "",
        "## What each row sends",
        "",
        *[f"- **{f.label}**: {f.how}." for f in FEATURES],
        "",
        "## The clusters",
        "",
        *[f"- `{name}`: {what}" for name, what in deployments.items()],
        "",
    ]
    if failed:
        lines += ["## Differences found", ""]
        lines += [f"- {f.label} × {c.label}: {results[cell_id(f.key, c.key)].get('detail', '')}" for f, c in failed]
        lines.append("")
    return "\n".join(lines)


TABLE_ROW = re.compile(r"^\|(.*)\|\s*$")


def parse_table(markdown: str) -> tuple[list[str], list[str], dict[tuple[str, str], str]]:
    """The doc's first table -> (column labels, feature labels, cell text by (feature, column) label)."""
    rows = []
    for line in markdown.splitlines():
        m = TABLE_ROW.match(line)
        if m:
            rows.append([c.strip() for c in re.split(r"(?<!\\)\|", m.group(1))])
        elif rows:
            break
    if len(rows) < 2:
        raise ValueError("no table found")
    head, body = rows[0], rows[2:]
    columns = head[1:]
    features = [r[0] for r in body]
    cells = {}
    for r in body:
        if len(r) != len(head):
            raise ValueError(f"row {r[0]!r} has {len(r)} cells, the header {len(head)}")
        for label, text in zip(columns, r[1:]):
            cells[r[0], label] = text
    return columns, features, cells


def is_known(text: str) -> bool:
    """A cell that says what is known: tested equal, differing, not applicable, or not run for want of a GPU."""
    return (text.startswith(TESTED) or text.startswith(DIFFERS) or text.startswith(f"{NOT_APPLICABLE}: ")
            or text.startswith(f"{NEEDS_GPU}: "))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=DEFAULT_RESULTS)
    parser.add_argument("--write", type=Path, default=DOC)
    args = parser.parse_args(argv)
    run = json.loads(args.results.read_text())
    args.write.write_text(render(run["cells"], run["date"], run["deployments"]))
    print(f"wrote {args.write}")


if __name__ == "__main__":
    main()
