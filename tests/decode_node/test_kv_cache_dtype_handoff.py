"""Prefill and decode workers (in this process) with bfloat16 KV caches under float32
activations: the prompt's KV crosses in bfloat16, by ZMQ frames or written in place into the
decode worker's shared pool, and the decode worker continues exactly as one engine with the
same cache would; a prefill worker whose cache is float32 is refused at the handshake, saying
why, and the decode worker serves on."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator

import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.bench.kv_dtype import PARITY_PROMPTS, default_model
from tandem.config import KVTransferConfig, WorkerConfig
from tandem.decode_node.worker import DecodeWorker
from tandem.kvtransfer.protocol import TransferRefused
from tandem.model.loader import LoadedModel
from tandem.prefill_node.worker import PrefillWorker
from tandem.worker import base
from tandem.worker.api import StreamDelta, WorkerRequest

PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
_ids = itertools.count()


@pytest.fixture(scope="module")
def int4() -> LoadedModel:
    """The default model as a worker loads it (int4 from its GGUF file), loaded once."""
    loaded, fmt = default_model(None, "auto")
    assert fmt == "int4"
    return loaded


@pytest.fixture(scope="module")
def workers(int4) -> Iterator[dict[str, PrefillWorker | DecodeWorker]]:
    """A bfloat16 decode worker, bfloat16 prefill workers sending by zmq and by shared memory,
    and a float32 one; all on the weights loaded once (each worker's load is this one)."""
    patch = pytest.MonkeyPatch()
    patch.setattr(base, "load_model", lambda source, dtype: int4)

    def config(transport: str, **engine: object) -> WorkerConfig:
        # (int4 named: auto would read the GGUF file's metadata once more per worker)
        return WorkerConfig.build(num_threads=1, kv_cache_memory_gib=0.05, quantization="int4",
                                  kv_transfer=KVTransferConfig(transport=transport, timeout_s=20), **engine)

    built: dict[str, PrefillWorker | DecodeWorker] = {}
    try:
        built["decode"] = DecodeWorker(config("auto", kv_cache_dtype="bfloat16"))
        built["zmq"] = PrefillWorker(config("zmq", kv_cache_dtype="bfloat16"), "prefill-zmq")
        built["auto"] = PrefillWorker(config("auto", kv_cache_dtype="bfloat16"), "prefill-shm")
        built["float32"] = PrefillWorker(config("zmq", kv_cache_dtype="float32"), "prefill-float32")
        yield built
    finally:
        for worker in built.values():
            worker.shutdown()
            if isinstance(worker, PrefillWorker):
                worker.sender.close()
        patch.undo()


async def _disaggregated(prefill: PrefillWorker, decode: DecodeWorker, prompt: list[int]) -> list[int]:
    """The request's tokens as the router would get them: reserve, prefill, start, stream."""
    request = WorkerRequest(f"r{next(_ids)}", prompt, PARAMS)
    destination = await decode.reserve(request)
    try:
        first = await prefill.prefill(request, destination)
    except BaseException:
        await decode.abort(request.request_id)
        raise
    await decode.start(first)
    deltas: list[StreamDelta] = []
    await decode.stream(request.request_id, deltas.append)
    assert all(d.error is None for d in deltas), deltas[-1].error
    return [t for d in deltas for t in d.token_ids]


@pytest.mark.parametrize("transport", ["zmq", "auto"])
def test_bf16_kv_crosses_and_decodes_as_one_engine(int4, workers, transport):
    decode, prefill = workers["decode"], workers[transport]
    assert isinstance(decode, DecodeWorker) and isinstance(prefill, PrefillWorker)
    assert decode.engine.runner.kv_cache.dtype == prefill.engine.runner.kv_cache.dtype == torch.bfloat16
    assert decode.receiver.layout.dtype == prefill.sender.layout.dtype == "bfloat16"
    assert int4.tokenizer is not None
    prompts = [int4.tokenizer.encode(p) for p in PARITY_PROMPTS[:2]]
    colocated = LLM.from_loaded(int4, quantization="int4", kv_cache_dtype="bfloat16", kv_cache_memory_gib=0.05)
    expected = [o.outputs[0].token_ids for o in colocated.generate([{"prompt_token_ids": p} for p in prompts],
                                                                   PARAMS)]
    received = decode.receiver.num_bytes_received
    got = [asyncio.run(_disaggregated(prefill, decode, p)) for p in prompts]
    assert got == expected
    if transport == "zmq":  # (in place, the rows are in the pool before any message)
        assert decode.receiver.num_bytes_received > received


def test_a_float32_prefill_worker_is_refused_by_a_bf16_decode_worker(int4, workers):
    decode, prefill = workers["decode"], workers["float32"]
    assert isinstance(decode, DecodeWorker) and isinstance(prefill, PrefillWorker)
    assert prefill.engine.runner.kv_cache.dtype == torch.float32
    assert int4.tokenizer is not None
    prompt = int4.tokenizer.encode(PARITY_PROMPTS[2])
    with pytest.raises(TransferRefused, match=r"dtype differs: receiver has bfloat16, sender has float32: KV cache "
                                              r"dtypes must match \(give both pools the same --kv-cache-dtype\)"):
        asyncio.run(_disaggregated(prefill, decode, prompt))
    # Nothing held on either side, and the decode worker serves a matching sender on.
    for worker in (decode, prefill):
        held = worker.engine.inventory()
        assert (held.num_requests, held.num_reserved, held.num_free_blocks) == (0, 0, held.num_blocks)
    assert len(asyncio.run(_disaggregated(workers["zmq"], decode, prompt))) == PARAMS.max_tokens
