"""The disk tier under the real engine and model: a prompt whose prefix the pool evicted
finds it on disk, loads it instead of recomputing it, and gives transformers' greedy tokens;
a tier file with one flipped byte costs a recompute of that block and what follows, never a
wrong token; every block is free at the end."""

from __future__ import annotations

import pytest
from engine_checks import assert_all_blocks_free
from metrics_text import parse_samples, total
from reference import english_token_ids, hf_greedy

from tandem import SamplingParams
from tandem.kvcache.block_hash import prefix_hashes
from tandem.worker.api import Role
from tandem.worker.metrics import WorkerMetrics

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
PROMPT_LEN = 200  # 12 full blocks
MAX_TOKENS = 8


def test_evicted_prefixes_load_from_disk_and_a_flipped_byte_is_recomputed(make_llm, hf_model, loaded, tokenizer,
                                                                           tmp_path):
    llm = make_llm(block_size=BLOCK_SIZE, num_kv_blocks=20, kv_offload_disk_gib=0.05, kv_offload_dir=str(tmp_path))
    tier = llm.engine.block_manager.tier
    assert tier is not None and tier.directory.startswith(str(tmp_path))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    prompt = english_token_ids(tokenizer, PROMPT_LEN, skip=40)
    others = [english_token_ids(tokenizer, PROMPT_LEN, skip=400 + 300 * i) for i in range(2)]
    expected = hf_greedy(hf_model, prompt, MAX_TOKENS, loaded.config.eos_token_ids)

    def run_then_evict() -> tuple[list[int], int, int]:
        """-> the prompt's tokens, its cached tokens and the blocks it loaded from disk."""
        loaded_before = tier.counters.num_loaded_blocks
        (out,) = llm.generate([prompt], params)
        num_loaded = tier.counters.num_loaded_blocks - loaded_before
        for other in others:  # each takes most of the 20-block pool: the prompt's blocks go to disk
            llm.generate([other], params)
        return out.token_ids, out.num_cached_tokens, num_loaded

    tokens, cached, num_loaded = run_then_evict()
    assert tokens == expected and cached == num_loaded == 0
    tier.flush()
    hashes = prefix_hashes(prompt, BLOCK_SIZE)
    assert all(tier.holds(h) for h in hashes) and not any(h in llm.engine.block_manager.cached_block_ids
                                                          for h in hashes)
    tokens, cached, num_loaded = run_then_evict()
    assert tokens == expected and cached == 12 * BLOCK_SIZE and num_loaded == 12  # every full block loaded

    tier.flush()
    path = tier.path_of(hashes[5])
    data = bytearray(open(path, "rb").read())
    data[-100] ^= 0x10
    open(path, "wb").write(bytes(data))
    tokens, cached, num_loaded = run_then_evict()
    assert tokens == expected and cached == 5 * BLOCK_SIZE and num_loaded == 5  # blocks 0-4 loaded; 5 on recomputed
    assert tier.counters.num_corrupt_blocks == 1
    assert_all_blocks_free(llm)
    # The worker's metrics read the same counters.
    s = parse_samples(WorkerMetrics(Role.COLOCATED, "c-0", "m").render(llm.engine))
    assert total(s, "tandem_kv_tier_hit_tokens_total", tier="disk") == tier.counters.num_loaded_blocks * BLOCK_SIZE
    assert total(s, "tandem_kv_tier_blocks_lost_total", tier="disk", reason="corrupt") == 1
    assert total(s, "tandem_kv_tier_bytes_total", direction="offload") == tier.counters.num_offloaded_bytes > 0
    # The loads were charged to the step budgets they ran in (engine/tier_load_cost.py).
    charged = llm.engine.scheduler.prefill_packer.load_cost.num_charged_tokens
    assert total(s, "tandem_kv_tier_load_budget_tokens_total") == charged > 0
    tier.close()
