"""Tensor-parallel workers on real clusters: a prefill worker at tp=2 feeding a decode worker
at tp=1, and the reverse. Each rank is a Ray actor in the worker's placement group, on gloo;
3 KV heads over 2 ranks split 2 + 1, so the KV transfer maps head shards between pools.
Greedy output must equal transformers' and the colocated (tp=1) worker's, token for token,
also when a tp=2 pool loads an evicted prefix back from its disk tier."""

from __future__ import annotations

import pytest
import ray
from completions_checks import completions, sampled_request
from metrics_text import parse_samples, total
from reference import english_token_ids, hf_greedy
from running_cluster import running_clusters
from worker_checks import assert_workers_empty

from tandem.config import WorkerConfig
from tandem.proto import generation_pb2 as pb
from tandem.router.cluster import ClusterConfig

pytestmark = pytest.mark.slow



def tp_worker(kv_offload_dir: str) -> WorkerConfig:
    """Pools of about 700 tokens (float32 KV, every head: 46 KB a token) and a disk tier the
    cluster's workers share."""
    return WorkerConfig.build(kv_cache_memory_gib=0.03, max_num_batched_tokens=256, num_threads=1,
                              quantization="none", kv_offload_disk_gib=0.5, kv_offload_dir=kv_offload_dir)

QUESTIONS = ("What is the capital of France?", "Write a haiku about the sea.")


@pytest.fixture(scope="module")
def tp_clusters(clusters, tmp_path_factory):
    offload_dir = str(tmp_path_factory.mktemp("kv-offload"))
    configs = {
        "prefill tp=2": ClusterConfig(num_prefill=1, num_decode=1, prefill_tp=2, disagg_policy="always",
                                      worker=tp_worker(offload_dir), name_prefix="tp21-", num_cpus_per_rank=0.5),
        "decode tp=2": ClusterConfig(num_prefill=1, num_decode=1, decode_tp=2, disagg_policy="always",
                                     worker=tp_worker(offload_dir), name_prefix="tp12-", num_cpus_per_rank=0.5),
    }
    with running_clusters(configs, clusters["colocated"].loop) as started:
        yield started


def greedy_tokens(cluster, prompt: list[int], max_tokens: int) -> list[int]:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                 sampling=pb.SamplingParams(temperature=0, max_tokens=max_tokens))
    return [t for r in cluster.stub().Generate(request, timeout=300) for t in r.token_ids]


def prompts(tokenizer) -> list[list[int]]:
    chats = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                            add_generation_prompt=True)) for q in QUESTIONS]
    # 300 tokens: chunked over two prefill steps (256-token budget), sent as each chunk is done.
    return chats + [english_token_ids(tokenizer, 300)]


@pytest.mark.parametrize("name", ["prefill tp=2", "decode tp=2"])
def test_tensor_parallel_pool_gives_transformers_and_colocated_greedy_tokens(tp_clusters, clusters, name, hf_model,
                                                                             tokenizer, loaded):
    eos = loaded.config.eos_token_ids
    for prompt in prompts(tokenizer):
        expected = hf_greedy(hf_model, prompt, 16, eos)
        assert greedy_tokens(tp_clusters[name], prompt, 16) == expected
        assert greedy_tokens(clusters["colocated"], prompt, 16) == expected
    assert_workers_empty(tp_clusters[name])


@pytest.mark.parametrize(("name", "role"), [("prefill tp=2", "prefill"), ("decode tp=2", "decode")])
def test_a_tensor_parallel_pool_loads_an_evicted_history_from_its_disk_tier(tp_clusters, name, role, hf_model,
                                                                            tokenizer, loaded):
    """A 200-token history, then 1200 tokens of other prompts through the ~700-token pools:
    the tp=2 worker's copy of the history went to disk (every head gathered from its ranks).
    The next turn loads it back into both ranks' shares and gives transformers' tokens."""
    cluster = tp_clusters[name]
    history = english_token_ids(tokenizer, 200, skip=700)
    hits_before, offloaded_before = tier_hit_tokens(cluster, role), offloaded_bytes(cluster, role)
    answer = greedy_tokens(cluster, history, 8)
    for i in range(4):
        greedy_tokens(cluster, english_token_ids(tokenizer, 300, skip=1000 + 350 * i), 1)
    prompt = history + answer + english_token_ids(tokenizer, 10, skip=50)
    assert greedy_tokens(cluster, prompt, 8) == hf_greedy(hf_model, prompt, 8, loaded.config.eos_token_ids)
    # the history's 12 full blocks of 16 tokens, loaded on the tp=2 worker, which gathered
    # blocks from its ranks for the disk (the other worker shares the folder)
    assert tier_hit_tokens(cluster, role) - hits_before >= 12 * 16
    assert offloaded_bytes(cluster, role) > offloaded_before
    assert_workers_empty(cluster)


def tier_hit_tokens(cluster, role: str) -> float:
    return total(parse_samples(cluster.scrape()), "tandem_kv_tier_hit_tokens_total", tier="disk", role=role)


def offloaded_bytes(cluster, role: str) -> float:
    return total(parse_samples(cluster.scrape()), "tandem_kv_tier_bytes_total", direction="offload", role=role)


@pytest.mark.parametrize("name", ["prefill tp=2", "decode tp=2"])
def test_tensor_parallel_forks_equal_the_colocated_workers(tp_clusters, clusters, name, tokenizer):
    """n=3 sampled completions: forks share the prompt's blocks and copy a partly filled one
    on every rank (the copies travel in the step messages), with the same seeds as tp=1."""
    prompt = english_token_ids(tokenizer, 40, skip=100)
    want = completions(list(clusters["colocated"].stub().Generate(sampled_request(prompt, 11, 3, 12), timeout=300)), 3)
    got = completions(list(tp_clusters[name].stub().Generate(sampled_request(prompt, 11, 3, 12), timeout=300)), 3)
    assert got == want
    assert_workers_empty(tp_clusters[name])


def test_tensor_parallel_ranks_share_their_workers_placement_group(tp_clusters):
    """Each tp=2 worker reserved one bundle per rank, all on one node, and its other rank runs there."""
    for name, role in (("prefill tp=2", "prefill"), ("decode tp=2", "decode")):
        (worker,) = [w for w in tp_clusters[name].backend.workers if role in w.instance]
        group = worker.placement_group
        assert group is not None and len(group.bundle_specs) == 2
        table = ray.util.placement_group_table(group)
        assert table["strategy"] == "STRICT_PACK" and table["state"] == "CREATED"
        assert len(set(table["bundles_to_node_id"].values())) == 1
