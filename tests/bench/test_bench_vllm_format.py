"""`tandem bench serve --save-result` writes vLLM's flat keys; `--dataset-name sharegpt` samples a
ShareGPT file as vLLM does (first turn the prompt, the reply's token count the output length,
vLLM's length filter)."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from tandem.bench.serving.load import RequestResult, summarize
from tandem.bench.serving.vllm_format import flat_result, result_file_name, sharegpt_requests


def test_flat_keys_are_vllms_and_carry_the_summary():
    results = [RequestResult(i, "short", 10, 4) for i in range(3)]
    for i, r in enumerate(results):
        r.success, r.output_tokens, r.ttft_ms = True, 4, 10.0 * (i + 1)
        r.tpot_ms, r.e2el_ms, r.itl_ms = 5.0, 30.0, [5.0]
    metrics = summarize(results, 2.0, {"ttft": 25.0})
    flat = flat_result(metrics, model="m", label="server", num_prompts=3, rate=1.5, burstiness=1.0,
                       max_concurrency=None)
    for key in ("mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms",
                "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms", "p90_e2el_ms", "request_goodput", "request_throughput",
                "output_throughput", "total_token_throughput", "completed", "duration", "num_prompts",
                "request_rate", "model_id", "backend"):
        assert key in flat, key
    assert flat["mean_ttft_ms"] == pytest.approx(20.0) and flat["median_ttft_ms"] == pytest.approx(20.0)
    assert flat["request_goodput"] == pytest.approx(2 / 2.0)  # two of three within 25 ms
    assert flat["completed"] == 3 and flat["total_output_tokens"] == 12 and flat["request_rate"] == 1.5
    json.dumps(flat)


def test_sharegpt_sampling_follows_vllms_filter(tmp_path, tokenizer):
    plain = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    conversations = [
        {"conversations": [{"from": "human", "value": "What is the capital of France? Tell me."},
                           {"from": "gpt", "value": "The capital of France is Paris, a large city."}]},
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there, how are you?"}]},
        {"conversations": [{"from": "human", "value": "Only one turn here."}]},
        {"conversations": [{"from": "human", "value": "word " * 1100}, {"from": "gpt", "value": "A long reply."}]},
        {"conversations": [{"from": "human", "value": "Name three colours, please."},
                           {"from": "gpt", "value": "Red, green and blue are three colours."}]},
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(conversations))
    requests = sharegpt_requests(str(path), plain, 2, seed=0)
    # Kept: the first and the last (a 1-token prompt, a single turn and a >1024-token prompt go).
    kept = {tuple(plain.encode(c["conversations"][0]["value"]).ids): c["conversations"][1]["value"]
            for c in (conversations[0], conversations[4])}
    assert len(requests) == 2 and {tuple(r.prompt_token_ids) for r in requests} == set(kept)
    for r in requests:
        assert r.output_len == len(plain.encode(kept[tuple(r.prompt_token_ids)]).ids)
    with pytest.raises(ValueError, match="only 2 conversations pass"):
        sharegpt_requests(str(path), plain, 3, seed=0)


def test_a_repeated_runs_file_name_has_no_spaces_or_parentheses():
    run = {"label": "colocated/budget 512", "phase": "sweep (repeat)", "rate": 0.5}
    assert result_file_name(run) == "tandem-colocated-budget-512-sweep-repeat-0.5qps.json"
