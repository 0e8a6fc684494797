"""Multi-turn chat on the disaggregated cluster's workers behind a prefix_aware router: the
second turn goes to the decode worker that served the first, only the KV of the tokens
that worker does not cache travels, and the output is the single-process engine's."""

from __future__ import annotations

import pytest
from metrics_text import parse_samples, total
from reference import english_token_ids
from worker_checks import assert_workers_empty

from tandem import SamplingParams
from tandem.router.policy import WorkerState
from tandem.router.ray_backend import RayBackend

pytestmark = pytest.mark.slow

MAX_TOKENS = 10


async def prefix_aware_backend(backend: RayBackend) -> RayBackend:
    """A second router over the same worker actors, with the prefix_aware policy."""
    prefill, decode = ([WorkerState(w.instance, w.handle) for w in pool] for pool in (backend.prefill, backend.decode))
    prefix = RayBackend(prefill, decode, [], "prefix_aware", backend.tokenizer_spec, disagg_policy="always")
    await prefix.loads()
    return prefix


async def generate(backend: RayBackend, request_id: str, prompt: list[int]) -> list[int]:
    await backend.loads()  # not polling: fresh loads (and block sizes) before routing
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [t async for delta in backend.generate(request_id, prompt, params) for t in delta.token_ids]


def test_second_turn_reuses_the_first_turns_kv(clusters, make_llm, tokenizer, hf_model):
    cluster = clusters["disaggregated"]
    assert_workers_empty(cluster)
    backend = cluster.run(prefix_aware_backend(cluster.backend))
    decode_instances = [w.instance for w in backend.decode]
    turn1 = english_token_ids(tokenizer, 60, skip=357)

    def served(before, after) -> list[str]:
        return [i for i in decode_instances
                if total(after, "tandem_request_decode_time_seconds_count", instance=i)
                > total(before, "tandem_request_decode_time_seconds_count", instance=i)]

    samples = [parse_samples(cluster.scrape())]
    answer1 = cluster.run(generate(backend, "turn-1", turn1))
    assert_workers_empty(cluster)
    samples.append(parse_samples(cluster.scrape()))
    turn2 = turn1 + answer1 + english_token_ids(tokenizer, 25, skip=901)
    answer2 = cluster.run(generate(backend, "turn-2", turn2))
    assert_workers_empty(cluster)
    samples.append(parse_samples(cluster.scrape()))

    first, = served(samples[0], samples[1])
    assert served(samples[1], samples[2]) == [first]
    # The decode worker computed turn 1's prompt and all but its last output token: its
    # full blocks (which reach past turn 1's prompt, into the answer) are not sent again.
    block_size = next(w.load.block_size for w in backend.decode if w.instance == first)
    num_cached = (len(turn1) + MAX_TOKENS - 1) // block_size * block_size
    assert num_cached > len(turn1)
    cfg = hf_model.config
    token_bytes = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
    for direction in ("sent", "received"):
        moved = (total(samples[2], "tandem_kv_transfer_bytes_total", direction=direction)
                 - total(samples[1], "tandem_kv_transfer_bytes_total", direction=direction))
        assert moved == (len(turn2) - num_cached) * token_bytes
    hits = (total(samples[2], "tandem_prefix_cache_hits_total", role="decode", instance=first)
            - total(samples[1], "tandem_prefix_cache_hits_total", role="decode", instance=first))
    assert hits == num_cached
    expected = make_llm().generate([turn1, turn2], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                  ignore_eos=True))
    assert [answer1, answer2] == [o.token_ids for o in expected]
