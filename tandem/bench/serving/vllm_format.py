"""What `vllm bench serve` reads and writes, for `tandem bench serve`: its flat result keys
(``--save-result``: ``mean_ttft_ms``, ``p99_tpot_ms``, ``request_goodput``, ...) and its
ShareGPT dataset (``--dataset-name sharegpt --dataset-path FILE``), sampled as vLLM samples it."""

from __future__ import annotations

import datetime
import json
import random
import re
from typing import Any

from tandem.bench.serving.load import PERCENTILES, Request

METRICS = ("ttft", "tpot", "itl", "e2el")
SHAREGPT_MIN_LEN, SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL = 4, 1024, 2048
"""vLLM's ShareGPT filter: prompt and reply of at least 4 tokens, a prompt of at most 1024,
both together at most 2048."""


def result_file_name(run: dict[str, Any]) -> str:
    """--save-result's file for one run: its label, phase and rate, with anything but letters,
    digits, dots and dashes made a dash (no spaces or parentheses: "sweep (repeat)" -> "sweep-repeat")."""
    parts = (run["label"], run["phase"], f"{run['rate']:g}qps")
    return "tandem-" + "-".join(re.sub(r"[^A-Za-z0-9.]+", "-", p).strip("-") for p in parts) + ".json"


def flat_result(metrics: dict[str, Any], *, model: str | None, label: str, num_prompts: int, rate: float,
                burstiness: float, max_concurrency: int | None) -> dict[str, Any]:
    """One run's summary (load.summarize) under vLLM's flat keys."""
    out: dict[str, Any] = {
        "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "tandem", "label": label,
        "model_id": model, "num_prompts": num_prompts, "request_rate": rate, "burstiness": burstiness,
        "max_concurrency": max_concurrency, "duration": metrics["duration_s"], "completed": metrics["completed"],
        "failed": metrics["failed"], "total_input_tokens": metrics["total_input_tokens"],
        "total_output_tokens": metrics["total_output_tokens"], "request_throughput": metrics["request_throughput"],
        "request_goodput": metrics["goodput"], "output_throughput": metrics["output_throughput"],
        "total_token_throughput": metrics["total_token_throughput"],
    }
    for name in METRICS:
        stats = metrics[f"{name}_ms"]
        out[f"mean_{name}_ms"], out[f"median_{name}_ms"], out[f"std_{name}_ms"] = (
            stats["mean"], stats["median"], stats["std"])
        for p in PERCENTILES:
            out[f"p{p}_{name}_ms"] = stats[f"p{p}"]
    return out


def sharegpt_requests(path: str, tokenizer, num: int, seed: int) -> list[Request]:
    """`num` requests from a ShareGPT JSON file (a list of {"conversations": [{"from", "value"},
    ...]}): each conversation's first turn as the prompt, the second's token count as the
    output length, shuffled with `seed`, filtered as vLLM filters. `tokenizer`: a
    ``tokenizers.Tokenizer``."""
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    pairs = [(c["conversations"][0]["value"], c["conversations"][1]["value"]) for c in data
             if isinstance(c, dict) and len(c.get("conversations") or []) >= 2]
    random.Random(seed).shuffle(pairs)
    requests = []
    for prompt, reply in pairs:
        prompt_ids = tokenizer.encode(prompt).ids
        output_len = len(tokenizer.encode(reply).ids)
        if (len(prompt_ids) < SHAREGPT_MIN_LEN or output_len < SHAREGPT_MIN_LEN
                or len(prompt_ids) > SHAREGPT_MAX_PROMPT or len(prompt_ids) + output_len > SHAREGPT_MAX_TOTAL):
            continue
        requests.append(Request(prompt_ids, output_len, "long" if len(prompt_ids) > 256 else "short"))
        if len(requests) == num:
            return requests
    raise ValueError(f"{path}: only {len(requests)} conversations pass vLLM's ShareGPT filter, {num} asked for")
