"""The router hop of ``tandem bench serve``: the latency the gRPC router adds to a request,
measured against the same kind of request sent straight to the backend in this process."""

from __future__ import annotations

import time

import grpc

from tandem.bench.serving.load import greedy_request, stats
from tandem.proto import generation_pb2_grpc as pb_grpc


async def router_overhead(target: str, backend, prompts: list[list[int]], tag: str) -> dict:
    """1-token requests, half sent through the router (gRPC), half straight to the backend in
    this process (``backend.generate``: the worker calls the router makes, minus gRPC,
    validation and tokenization), in pairs that alternate which goes first -> per-pair
    latency differences (ms). ``prompts``: 2 per pair plus 2 for warm-up, all different."""
    from tandem.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    via_router, direct = [], []
    async with grpc.aio.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def routed(i: int) -> float:
            t = time.perf_counter()
            async for _ in stub.Generate(greedy_request(f"{tag}-router-{i}", prompts[i], 1), timeout=120):
                pass
            return (time.perf_counter() - t) * 1e3

        async def straight(i: int) -> float:
            t = time.perf_counter()
            async for _ in backend.generate(f"{tag}-direct-{i}", prompts[i], params):
                pass
            return (time.perf_counter() - t) * 1e3

        await routed(0)  # warm both paths
        await straight(1)
        for pair in range(1, len(prompts) // 2):
            a, b = 2 * pair, 2 * pair + 1
            if pair % 2:
                via_router.append(await routed(a))
                direct.append(await straight(b))
            else:
                direct.append(await straight(b))
                via_router.append(await routed(a))
    added = [r - d for r, d in zip(via_router, direct)]
    return {"num_pairs": len(added), "router_ms": stats(via_router), "direct_ms": stats(direct),
            "added_ms": stats(added), "added_ms_values": added}
