"""Speculative decoding by prompt lookup, with and without, side by side on the real model.

Two workloads of greedy chat requests: "edit" (repeat a given passage with a small change:
the output copies the prompt, so drafts found in it should be accepted) and "open"
(open-ended questions: nothing to copy, so drafts should mostly be rejected). Each runs
as one batch at every --k (0: off), in alternating order over --rounds, each run on a
fresh engine (empty prefix cache) over one shared model load. Prints output tokens/s,
the acceptance rate (accepted / draft tokens) and the tokens/s ratio against k=0; writes
results.json and spec.png to --out-dir. Exits 1 if any greedy output differs from k=0's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on a bench machine
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from tandem.llm import LLM  # noqa: E402
from tandem.model.loader import LoadedModel, load_model  # noqa: E402
from tandem.model.source import resolve_model_source  # noqa: E402
from tandem.sampling_params import SamplingParams  # noqa: E402

logger = logging.getLogger(__name__)

PASSAGE = (
    "The old lighthouse stood at the end of a narrow path that wound between the dunes. For more than a "
    "hundred years its keepers had climbed the spiral stairs every evening to light the lamp, and every "
    "morning they had climbed them again to put it out. The last keeper, a quiet man named Thomas, kept a "
    "notebook in which he wrote down the weather, the ships he saw, and the birds that rested on the railing. "
    "In winter the wind was so strong that the windows rattled all night, and the sea threw spray as high as "
    "the gallery. In summer the water was calm and blue, and children from the village walked along the beach "
    "to wave at him. When the lamp was finally replaced by an automatic light, Thomas moved to a small house "
    "in the village. He still walked to the lighthouse every morning, and he still wrote in his notebook, "
    "although now he wrote mostly about the children, who had grown up and had children of their own."
)
EDIT_INSTRUCTIONS = [
    "Repeat the following text exactly, but change the name Thomas to Peter.",
    "Copy the following text word for word, but replace the word village with town.",
    "Rewrite the following text without any changes, except write lamp as lantern.",
    "Repeat the following text, changing only the word winter to autumn.",
]
OPEN_QUESTIONS = [
    "What are some good ways to stay healthy during a busy week?",
    "Write a short story about a robot who wants to learn how to paint.",
    "Why do people enjoy travelling to new places?",
    "Give me some ideas for a birthday party for a ten year old.",
]


def add_args(parser: argparse.ArgumentParser) -> None:
    """Options of ``tandem bench spec``; ``--quick`` changes the defaults of the unset ones."""
    parser.add_argument("--model", default=None,
                        help="local HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads (default: all cores)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny run: 1 prompt per workload, 24 tokens, k 0 4, 1 round")
    parser.add_argument("--k", type=int, nargs="+", default=None,
                        help="num_speculative_tokens to compare; 0 is always run (default: 0 2 4)")
    parser.add_argument("--num-prompts", type=int, default=None, help="requests per batch, at most 4 (default: 4)")
    parser.add_argument("--max-tokens", type=int, default=None, help="output tokens per request at most (default: 128)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="timed runs per k and workload, order alternating (default: 2)")
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--out-dir", default="bench-results/spec", help="where results.json and spec.png go")


def _settings(args: argparse.Namespace) -> tuple[list[int], int, int, int]:
    """(ks, num_prompts, max_tokens, rounds) from the options and their defaults."""
    ks, n, max_tokens, rounds = ([0, 4], 1, 24, 1) if args.quick else ([0, 2, 4], 4, 128, 2)
    ks = sorted({0, *(args.k if args.k is not None else ks)})
    n = args.num_prompts if args.num_prompts is not None else n
    max_tokens = args.max_tokens if args.max_tokens is not None else max_tokens
    rounds = args.rounds if args.rounds is not None else rounds
    if min(ks) < 0 or not 1 <= n <= len(OPEN_QUESTIONS) or max_tokens < 1 or rounds < 1:
        raise ValueError(f"need k >= 0, 1 <= num-prompts <= {len(OPEN_QUESTIONS)}, max-tokens >= 1, rounds >= 1")
    return ks, n, max_tokens, rounds


def workloads(tokenizer: Any, num_prompts: int) -> dict[str, list[list[int]]]:
    """The chat-templated prompt token ids of each workload (as ``LLM.apply_chat_template``);
    ``tokenizer`` is the model's transformers tokenizer."""
    def chat(text: str) -> list[int]:
        templated = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=False)
        return tokenizer.encode(templated, add_special_tokens=False)

    return {"edit": [chat(f"{instruction}\n\n{PASSAGE}") for instruction in EDIT_INSTRUCTIONS[:num_prompts]],
            "open": [chat(question) for question in OPEN_QUESTIONS[:num_prompts]]}


def run_batch(loaded: LoadedModel, k: int, prompts: list[list[int]], params: SamplingParams,
              lookup: tuple[int, int]) -> dict:
    """One batch on a fresh engine: wall seconds, output token ids and the draft counters."""
    llm = LLM.from_loaded(loaded, kv_cache_memory_gib=0.25, num_speculative_tokens=k,
                          prompt_lookup_max=lookup[0], prompt_lookup_min=lookup[1])
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    counters = llm.engine.counters()
    return {"seconds": seconds, "outputs": [o.token_ids for o in outputs],
            "draft_tokens": counters.num_draft_tokens, "accepted_tokens": counters.num_accepted_draft_tokens}


def bench_workload(loaded: LoadedModel, name: str, prompts: list[list[int]], ks: list[int], rounds: int,
                   params: SamplingParams, lookup: tuple[int, int]) -> list[dict]:
    """Every k over ``rounds`` runs, the order reversed each round; a row per k."""
    runs: dict[int, list[dict]] = {k: [] for k in ks}
    for r in range(rounds):
        for k in ks if r % 2 == 0 else ks[::-1]:
            runs[k].append(run_batch(loaded, k, prompts, params, lookup))
            logger.info("%s, k=%d, round %d: %.2f s", name, k, r + 1, runs[k][-1]["seconds"])
    baseline = runs[0][0]["outputs"]
    rows = []
    for k in ks:
        seconds = sum(run["seconds"] for run in runs[k])
        tokens = sum(len(o) for run in runs[k] for o in run["outputs"])
        drafts = sum(run["draft_tokens"] for run in runs[k])
        accepted = sum(run["accepted_tokens"] for run in runs[k])
        rows.append({"workload": name, "k": k, "runs": rounds, "output_tokens": tokens, "seconds": seconds,
                     "tok_s": tokens / seconds, "draft_tokens": drafts, "accepted_tokens": accepted,
                     "acceptance_rate": accepted / drafts if drafts else None,
                     "same_outputs": all(run["outputs"] == baseline for run in runs[k])})
    for row in rows:
        row["ratio"] = row["tok_s"] / rows[0]["tok_s"]
    return rows


def print_report(results: dict) -> None:
    """The table of every (workload, k) and the ratios against k=0."""
    print(f"\n== tandem bench spec: {results['model']}, {results['num_threads']} torch threads, "
          f"{results['num_prompts']} prompts per batch, greedy, max_tokens {results['max_tokens']}, "
          f"{results['rounds']} round(s), prompt lookup n-grams {results['prompt_lookup_min']}.."
          f"{results['prompt_lookup_max']} ==")
    print("tok/s = output tokens / wall seconds of the batch; acceptance = accepted / draft tokens\n")
    print(f"{'workload':>8} {'k':>3} {'out tokens':>10} {'tok/s':>8} {'drafts':>7} {'accepted':>8} "
          f"{'acceptance':>10} {'vs k=0':>7} {'same output':>11}")
    for r in results["rows"]:
        rate = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.0%}"
        print(f"{r['workload']:>8} {r['k']:>3} {r['output_tokens']:>10} {r['tok_s']:>8.1f} {r['draft_tokens']:>7} "
              f"{r['accepted_tokens']:>8} {rate:>10} {r['ratio']:>6.2f}x {'yes' if r['same_outputs'] else 'NO':>11}")
    ratios = ", ".join(f"{r['workload']} k={r['k']}: {r['ratio']:.2f}x" for r in results["rows"] if r["k"])
    print(f"\ntokens/s with / without speculation: {ratios}")


def write_plot(results: dict, path: Path) -> None:
    """Tokens/s ratio against k=0 and acceptance rate, per workload and k."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    ks = sorted({r["k"] for r in results["rows"]})
    names = list(dict.fromkeys(r["workload"] for r in results["rows"]))
    width = 0.8 / len(ks)
    for i, k in enumerate(ks):
        rows = [next(r for r in results["rows"] if r["workload"] == name and r["k"] == k) for name in names]
        xs = [j + i * width for j in range(len(names))]
        left.bar(xs, [r["ratio"] for r in rows], width, label=f"k={k}")
        right.bar(xs, [r["acceptance_rate"] or 0 for r in rows], width, label=f"k={k}")
    for ax, title in ((left, "output tokens/s, relative to k=0"), (right, "acceptance rate (accepted / drafts)")):
        ax.set_xticks([j + width * (len(ks) - 1) / 2 for j in range(len(names))], names)
        ax.set_title(title)
        ax.legend()
    left.axhline(1.0, color="grey", linewidth=0.8)
    fig.suptitle(f"prompt lookup speculative decoding, {results['model']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    ks, num_prompts, max_tokens, rounds = _settings(args)
    threads = args.num_threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    loaded = load_model(resolve_model_source(args.model), torch.float32)
    lookup = (args.prompt_lookup_max, args.prompt_lookup_min)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    prompts = workloads(loaded.tokenizer, num_prompts)
    # Warm-up, untimed: first-call costs of both workloads' prompt lengths and of verifying drafts.
    run_batch(loaded, max(ks), [batch[0] for batch in prompts.values()], SamplingParams(temperature=0, max_tokens=8),
              lookup)
    rows = [row for name, batch in prompts.items()
            for row in bench_workload(loaded, name, batch, ks, rounds, params, lookup)]
    results = {"model": loaded.config.name, "num_threads": threads, "quick": args.quick, "ks": ks,
               "num_prompts": num_prompts, "max_tokens": max_tokens, "rounds": rounds,
               "prompt_lookup_max": lookup[0], "prompt_lookup_min": lookup[1], "rows": rows,
               "outputs_identical": all(r["same_outputs"] for r in rows)}
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    write_plot(results, out_dir / "spec.png")
    print_report(results)
    print(f"\nwrote {out_dir / 'results.json'}, {out_dir / 'spec.png'}")
    if not results["outputs_identical"]:
        logger.error("greedy outputs with speculation differ from those without")
        return 1
    return 0
