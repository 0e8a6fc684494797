"""The first token leaves the decode worker as soon as the prefill worker's sample reaches
it, while the prompt's KV is still on its way (here: never sent at all); the request
joins the running batch only once the KV has landed, and every exit frees its blocks."""

from __future__ import annotations

import uuid

import pytest
import ray
from delta_sink import DeltaSink
from reference import english_token_ids
from worker_checks import assert_workers_empty

from tandem.sampling_params import SamplingParams
from tandem.worker.api import PrefillResult, WorkerRequest

pytestmark = pytest.mark.slow


@pytest.fixture
def sink():
    sink = DeltaSink()
    yield sink
    sink.close()


def _reserve_and_start(decode, prompt: list[int], max_tokens: int, token_id: int, sink: DeltaSink):
    """-> the request's id and its streaming call (its deltas go to ``sink``)."""
    rid = uuid.uuid4().hex
    request = WorkerRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=True))
    ray.get(decode.handle.reserve.remote(request), timeout=60)
    call = decode.handle.stream.remote(rid, sink.address)
    ray.get(decode.handle.start.remote(PrefillResult(rid, [token_id], [-0.25], 0)), timeout=60)
    return rid, call


def test_first_token_is_streamed_before_the_kv_arrives(clusters, tokenizer, sink):
    cluster = clusters["disaggregated"]
    decode = cluster.backend.decode[0]
    prompt = english_token_ids(tokenizer, 40, skip=5)
    token_id = english_token_ids(tokenizer, 1, skip=77)[0]
    rid, call = _reserve_and_start(decode, prompt, 5, token_id, sink)
    first = sink.next()
    assert (first.token_ids, first.logprobs, first.finish_reason) == ([token_id], [-0.25], None)
    assert first.text == tokenizer.decode([token_id])
    inventory = ray.get(decode.handle.inventory.remote(), timeout=30)
    # Streamed, but not decoding: its KV has not arrived.
    assert (inventory.num_running, inventory.num_first_tokens, inventory.num_pending_transfers) == (0, 1, 1)
    assert ray.get(decode.handle.abort.remote(rid), timeout=30)
    last = sink.next()
    assert last.finish_reason == "abort" and last.request_finished
    assert ray.get(call, timeout=30) is None  # the call returns once its last delta is sent
    assert_workers_empty(cluster)


def test_a_first_token_that_ends_the_request_frees_its_blocks_after_the_transfer(clusters, tokenizer, sink):
    cluster = clusters["disaggregated"]
    decode = cluster.backend.decode[0]
    prompt = english_token_ids(tokenizer, 40, skip=9)
    rid, call = _reserve_and_start(decode, prompt, 1, english_token_ids(tokenizer, 1, skip=3)[0], sink)
    (last,) = sink.until_finished()
    ray.get(call, timeout=30)
    assert last.finish_reason == "length" and last.request_finished and last.num_output_tokens == 1
    # The stream has ended, but the KV may still be landing in the request's blocks.
    inventory = ray.get(decode.handle.inventory.remote(), timeout=30)
    assert (inventory.num_first_tokens, inventory.num_pending_transfers) == (1, 1)
    assert inventory.num_free_blocks < inventory.num_blocks
    assert not ray.get(decode.handle.abort.remote(rid), timeout=30)  # nothing left to end, only blocks to free
    assert_workers_empty(cluster)
