"""Malformed calls on the workers' Ray methods (the router never makes them, but a bug or a
stray client on the Ray cluster might): each fails alone with a clear error, the worker keeps
serving, and a request running beside them is untouched (same output, blocks freed after)."""

from __future__ import annotations

import dataclasses

import pytest
import ray
from fault_calls import greedy, request
from ray.exceptions import RayTaskError
from reference import english_token_ids
from worker_checks import assert_workers_empty

from tandem.kvtransfer.protocol import Destination
from tandem.sampling_params import SamplingParams
from tandem.worker.api import PrefillResult, WorkerRequest

pytestmark = pytest.mark.slow


def _fails(ref, *fragments: str) -> str:
    with pytest.raises(RayTaskError) as e:
        ray.get(ref, timeout=60)
    message = str(e.value)
    assert all(f in message for f in fragments), message[-600:]
    return message


def _running_worker_id(cluster, client_id: str) -> str:
    """The worker id of the client's running call (the backend knows the call by its
    owner, the client's connection, and its id: servicer.owned_id)."""
    (worker_id,) = [w for owned, ids in cluster.backend._worker_ids.items()
                    if owned.endswith(f"/{client_id}") for w in ids]
    return worker_id


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_malformed_worker_calls_fail_alone(clusters, tokenizer, mode):
    cluster = clusters[mode]
    backend = cluster.backend
    assert_workers_empty(cluster)
    prompt = english_token_ids(tokenizer, 40, skip=11)
    expected = greedy(cluster, prompt, 24)
    running = request(prompt, 24)
    running.request_id = f"beside-{mode}"
    call = cluster.stub().Generate(running, timeout=120)
    first = next(call)  # decoding now, under an id only the router knows
    rid = _running_worker_id(cluster, running.request_id)
    params = SamplingParams(max_tokens=4)
    vocab = backend.tokenizer_spec.vocab_size
    duplicate = WorkerRequest(rid, [1, 2, 3], params)
    if mode == "colocated":
        (worker,) = backend.colocated
        for bad, fragments in [("junk", ("must be a WorkerRequest",)),
                               (duplicate, ("already in use",)),
                               (WorkerRequest("", [1], params), ("non-empty",)),
                               (WorkerRequest("x-1", [vocab + 5], params), ("vocab", "[0,")),
                               # A str for the params: the wrong type is what this sends.
                               (WorkerRequest("x-2", [1], "greedy"), ("SamplingParams",))]:  # type: ignore[arg-type]
            _fails(worker.handle.generate.remote(bad, "tcp://127.0.0.1:9"), *fragments)  # (refused before any send)
        request_ok = WorkerRequest("x-3", [1, 2], params)
        _fails(worker.handle.generate.remote(request_ok, "ipc:///tmp/x"), "tcp:// address")
    else:
        (prefill,) = backend.prefill
        decode = next(w for w in backend.decode if ray.get(w.handle.inventory.remote()).num_running)
        _fails(decode.handle.reserve.remote("junk"), "must be a WorkerRequest")
        _fails(decode.handle.reserve.remote(duplicate), "already in use")
        _fails(decode.handle.reserve.remote(WorkerRequest("x-3", [vocab], params)), "[0,")
        _fails(decode.handle.start.remote(PrefillResult(rid, [5], [0.0], 0)), "first token already")
        _fails(decode.handle.start.remote({"request_id": rid}), "must be a PrefillResult")
        assert ray.get(decode.handle.abort.remote("never-seen")) is False
        _fails(decode.handle.stream.remote(rid, None), "tcp:// address")
        destination = Destination("x-4", "tcp://127.0.0.1:1", (0,), 1)
        _fails(prefill.handle.prefill.remote(WorkerRequest("x-5", [1], params), destination), "destination is for")
        _fails(prefill.handle.prefill.remote(WorkerRequest("x-4", [1, 2], params), destination), "holds 1 tokens")
        _fails(prefill.handle.prefill.remote(WorkerRequest("x-4", [vocab + 1], params),
                                             dataclasses.replace(destination, num_tokens=1)), "[0,")
        _fails(prefill.handle.prefill.remote(None, destination), "must be a WorkerRequest")
    rest = list(call)
    assert list(first.token_ids) + [t for r in rest for t in r.token_ids] == expected
    assert greedy(cluster, prompt, 24) == expected  # and it still serves
    assert_workers_empty(cluster)
