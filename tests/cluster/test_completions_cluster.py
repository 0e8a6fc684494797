"""Several completions per request (sampling.n, beam search) and preemption by swap on the
real clusters, through the gRPC router, in both modes: the prefill worker samples each
completion's first token (or the beams' first candidates) and the decode worker forks them;
the colocated worker does both."""

from __future__ import annotations

import concurrent.futures

import pytest
import torch
from completions_checks import by_index, completions, sampled_request
from metrics_text import parse_samples, total
from reference import english_token_ids, hf_beam_search
from running_cluster import SameWorkers, running_clusters
from worker_checks import assert_workers_empty

from tandem.config import WorkerConfig
from tandem.proto import generation_pb2 as pb
from tandem.router.cluster import ClusterConfig

pytestmark = pytest.mark.slow

MODES = ["disaggregated", "colocated", "local"]
# Features whose path below the decision is the colocated one (the engine's), on the two pools only.
TWO_MODES = MODES[:2]
@pytest.mark.parametrize("mode", MODES)
def test_n_sampled_completions_equal_requests_seeded_seed_plus_index(clusters, tokenizer, mode):
    """n=4 at temperature 0.8: completion i is, token for token and in text, the request with
    seed + i and n=1 on the same cluster. Two prompts, and the eight single requests, at once."""
    cluster = clusters[mode]
    stub = cluster.stub()
    n, max_tokens = 4, 14
    prompts = {7: english_token_ids(tokenizer, 23, skip=200), 1000: english_token_ids(tokenizer, 41, skip=530)}

    def generate(prompt: list[int], seed: int, num: int) -> list[pb.GenerateResponse]:
        return list(stub.Generate(sampled_request(prompt, seed, num, max_tokens), timeout=120))

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        many_calls = {seed: pool.submit(generate, prompts[seed], seed, n) for seed in prompts}
        single_calls = {(seed, i): pool.submit(generate, prompts[seed], seed + i, 1)
                        for seed in prompts for i in range(n)}
        many = {seed: f.result() for seed, f in many_calls.items()}
        single = {key: completions(f.result(), 1)[0] for key, f in single_calls.items()}
    for seed, responses in many.items():
        got = completions(responses, n)
        assert got == [single[seed, i] for i in range(n)], seed
        assert responses[-1].usage.prompt_tokens == len(prompts[seed])
        for ids, text, reason in got:
            assert 1 <= len(ids) <= max_tokens and text == tokenizer.decode(ids, skip_special_tokens=True)
            assert reason == pb.FINISH_REASON_STOP or len(ids) == max_tokens
        # Sampled at 0.8 with different seeds, the completions differ (else forking proved nothing).
        assert len({tuple(ids) for ids, _, _ in got}) > 1
    assert_workers_empty(cluster)


@pytest.mark.parametrize("mode", MODES)
def test_beam_search_equals_transformers(clusters, tokenizer, hf_model, loaded, mode):
    """beam_width 3, n 2: the two best beams are transformers' two best, in order; one prompt
    whose beams run to max_tokens, one (a chat prompt) whose best beams end with EOS early."""
    cluster = clusters[mode]
    stub = cluster.stub()
    eos = loaded.config.eos_token_ids
    beam_width, n, max_tokens = 3, 2, 12
    prompts = [tokenizer.encode("The capital of France is"),
               tokenizer.encode(tokenizer.apply_chat_template(
                   [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True,
                   tokenize=False), add_special_tokens=False)]

    def beams(prompt: list[int]) -> list[pb.GenerateResponse]:
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
            temperature=0.0, use_beam_search=True, beam_width=beam_width, n=n, max_tokens=max_tokens))
        return list(stub.Generate(request, timeout=120))

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(beams, prompts))
    for prompt, responses in zip(prompts, results):
        expected = hf_beam_search(hf_model, prompt, max_tokens, eos, beam_width, 1.0, n)
        got = completions(responses, n)
        assert [ids for ids, _, _ in got] == expected, tokenizer.decode(prompt)
        assert [reason for _, _, reason in got] == [pb.FINISH_REASON_STOP if ids[-1] in eos else pb.FINISH_REASON_LENGTH
                                                   for ids in expected]
        assert [text for _, text, _ in got] == [tokenizer.decode(ids, skip_special_tokens=True) for ids in expected]
    # The chat prompt's best beam ends with EOS before max_tokens: finished beams are kept apart.
    assert any(reason == pb.FINISH_REASON_STOP for _, _, reason in completions(results[1], n))
    assert_workers_empty(cluster)


@pytest.mark.parametrize("mode", TWO_MODES)
def test_buffered_n_gives_one_response_per_completion(clusters, tokenizer, mode):
    cluster = clusters[mode]
    stub = cluster.stub()
    n, max_tokens = 3, 12
    prompt = english_token_ids(tokenizer, 30, skip=777)
    streamed = completions(list(stub.Generate(sampled_request(prompt, 42, n, max_tokens), timeout=120)), n)
    responses = list(stub.Generate(sampled_request(prompt, 42, n, max_tokens, buffered=True), timeout=120))
    assert [r.index for r in responses] == list(range(n)), "one response per completion, in index order"
    assert completions(responses, n) == streamed
    assert responses[-1].usage.prompt_tokens == len(prompt)
    assert_workers_empty(cluster)


# -- preemption by swap ------------------------------------------------------------------

BLOCK_SIZE = 16
NUM_KV_BLOCKS = 8
"""128 tokens: one request (at most 29 + 48 tokens, 5 blocks) fits alone, no two at their full length."""
SWAP_WORKER = WorkerConfig.build(num_kv_blocks=NUM_KV_BLOCKS, block_size=BLOCK_SIZE, preemption_mode="swap",
                                 max_num_batched_tokens=256, num_threads=1, quantization="none")
SWAP_MAX_TOKENS = 48


@pytest.fixture(scope="module")
def swap_clusters(clusters):
    """Every mode again, each worker's KV pool 8 blocks and preemption_mode="swap"."""
    with running_clusters({
            "disaggregated": ClusterConfig(num_prefill=1, num_decode=1, worker=SWAP_WORKER,
                                           name_prefix="swap-d-", disagg_policy="always"),
            "colocated": ClusterConfig(colocated=1, worker=SWAP_WORKER, name_prefix="swap-c-"),
            "local": SameWorkers("disaggregated", disagg_policy="never")},
            clusters["colocated"].loop) as started:
        yield started


def swap_prompts(tokenizer) -> list[list[int]]:
    return [english_token_ids(tokenizer, 20 + 3 * i, skip=60 + 97 * i) for i in range(4)]


def swap_counters(cluster, mode: str) -> tuple[float, float]:
    """(blocks swapped out, preemptions) of the worker that decodes, from the router's /metrics."""
    samples = parse_samples(cluster.scrape())
    role = "colocated" if mode == "colocated" else "decode"
    return (total(samples, "tandem_num_swapped_out_blocks_total", role=role),
            total(samples, "tandem_num_preemptions_total", role=role))


def run_on(cluster, request: pb.GenerateRequest) -> list[tuple[list[int], str, int]]:
    return completions(list(cluster.stub().Generate(request, timeout=300)), request.sampling.n or 1)


@pytest.mark.parametrize("mode", MODES)
def test_swap_preemption_keeps_greedy_output(clusters, swap_clusters, tokenizer, mode):
    """Four greedy requests at once on a worker whose pool holds one of them at its full
    length: the newest running ones are swapped out to host memory and back, and each gets
    exactly the tokens (and text) of an unconstrained run (the session cluster of the same mode)."""
    small, roomy = swap_clusters[mode], clusters[mode]
    requests = [pb.GenerateRequest(token_ids=pb.TokenIds(ids=p), sampling=pb.SamplingParams(
        temperature=0.0, max_tokens=SWAP_MAX_TOKENS, ignore_eos=True)) for p in swap_prompts(tokenizer)]
    swapped_before, preempted_before = swap_counters(small, mode)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        expected = list(pool.map(lambda r: run_on(roomy, r), requests))
        got = list(pool.map(lambda r: run_on(small, r), requests))
    assert all([(len(ids), reason)] == [(SWAP_MAX_TOKENS, pb.FINISH_REASON_LENGTH)] for (ids, _, reason), in expected)
    assert got == expected
    swapped, preempted = swap_counters(small, mode)
    assert swapped > swapped_before and preempted > preempted_before, (swapped, preempted)
    assert_workers_empty(small)
    assert_workers_empty(roomy)


@pytest.mark.parametrize("mode", TWO_MODES)
def test_swap_preemption_keeps_forked_completions(clusters, swap_clusters, tokenizer, mode):
    """The same with n=2 sampled completions (forks sharing their prompt's blocks): each
    equals the unconstrained run's."""
    small, roomy = swap_clusters[mode], clusters[mode]
    requests = [pb.GenerateRequest(token_ids=pb.TokenIds(ids=p), sampling=pb.SamplingParams(
        temperature=0.8, seed=i, n=2, max_tokens=40, ignore_eos=True)) for i, p in enumerate(swap_prompts(tokenizer))]
    swapped_before, _ = swap_counters(small, mode)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        expected = list(pool.map(lambda r: run_on(roomy, r), requests))
        got = list(pool.map(lambda r: run_on(small, r), requests))
    assert swap_counters(small, mode)[0] > swapped_before
    assert_workers_empty(small)
    assert got == expected


@pytest.mark.parametrize("mode", TWO_MODES)
def test_top_logprobs_are_the_models_at_every_position(clusters, tokenizer, hf_model, mode):
    """logprobs=4 with n=2 sampled completions: every message carries, per token, the 4 most
    likely tokens under transformers' forward (float64) after the tokens before it, the first
    from the prefill worker's sample, the rest from the decode worker's."""
    cluster = clusters[mode]
    prompt = english_token_ids(tokenizer, 19, skip=700)
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), sampling=pb.SamplingParams(
        temperature=0.8, seed=3, n=2, max_tokens=5, ignore_eos=True, logprobs=4))
    responses = list(cluster.stub().Generate(request, timeout=120))
    for index, messages in by_index(responses).items():
        assert all(len(r.top_logprobs) == len(r.token_ids) == len(r.logprobs) for r in messages)
        token_ids = [t for r in messages for t in r.token_ids]
        tops = [top for r in messages for top in r.top_logprobs]
        with torch.inference_mode():
            logits = hf_model(torch.tensor([prompt + token_ids])).logits[0].double()
        reference = torch.log_softmax(logits[len(prompt) - 1:-1], dim=-1).topk(4)
        assert [list(top.token_ids) for top in tops] == reference.indices.tolist(), index
        for top, values in zip(tops, reference.values.tolist()):
            assert list(top.logprobs) == pytest.approx(values, abs=1e-3)
    assert_workers_empty(cluster)
