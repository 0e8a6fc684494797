"""Abort reaches only the caller's own requests: its tenant's when API keys are set, its own
connection's when not. Another owner's request, even under the same id, is neither ended nor
reported, and owners may pick the same ids without meeting."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from fake_backend import FakeBackend
from router_harness import serving

from tandem.proto import generation_pb2 as pb
from tandem.proto import generation_pb2_grpc as pb_grpc
from tandem.router.auth import API_KEYS_ENV, AUTH_TOKEN_ENV, ApiKeys, api_keys_from_env
from tandem.router.server import bound_port

LONG = pb.SamplingParams(max_tokens=200, ignore_eos=True)


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


async def rest_of(call) -> list[pb.GenerateResponse]:
    rest = []
    while (response := await call.read()) is not grpc.aio.EOF:
        rest.append(response)
    return rest


def test_without_keys_a_connection_aborts_only_its_own(router_tokenizer):
    backend = FakeBackend(router_tokenizer, step_delay_s=0.2)  # mine still runs when I abort it

    async def body():
        async with serving(backend) as (mine, server):
            # (Channels of one process share a connection unless told not to: another client's.)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{bound_port(server)}",
                                                 options=[("grpc.use_local_subchannel_pool", 1)]) as theirs:
                my_stub, their_stub = pb_grpc.GenerationStub(mine), pb_grpc.GenerationStub(theirs)
                my_call = my_stub.Generate(pb.GenerateRequest(request_id="same", prompt="hi", sampling=LONG))
                their_call = their_stub.Generate(pb.GenerateRequest(request_id="same", prompt="hi", sampling=LONG))
                await my_call.read(), await their_call.read()
                # They name my id (which is also theirs): only their own request ends.
                theirs_aborted = await their_stub.Abort(pb.AbortRequest(request_ids=["same", "other"]))
                their_rest = await rest_of(their_call)
                still_running = await my_call.read()  # after their Abort, mine goes on
                mine_aborted = await my_stub.Abort(pb.AbortRequest(request_ids=["same"]))
                my_rest = [still_running, *await rest_of(my_call)]
                return theirs_aborted, their_rest, mine_aborted, my_rest

    theirs_aborted, their_rest, mine_aborted, my_rest = asyncio.run(body())
    assert list(theirs_aborted.aborted_request_ids) == ["same"] and list(mine_aborted.aborted_request_ids) == ["same"]
    assert their_rest[-1].finish_reason == pb.FINISH_REASON_ABORT
    assert my_rest[-1].finish_reason == pb.FINISH_REASON_ABORT
    # Mine was still running when I aborted it: their Abort never touched it.
    assert sum(len(r.token_ids) for r in my_rest) > 0 and backend.aborted == ["same", "same"]


def test_with_keys_a_tenant_aborts_only_its_own(router_tokenizer):
    backend = FakeBackend(router_tokenizer, step_delay_s=0.02)
    keys = ApiKeys({"key-a": "acme", "key-a2": "acme", "key-b": "bobs"})

    async def body():
        async with serving(backend, auth_token=keys) as (channel, server):
            stub = pb_grpc.GenerationStub(channel)
            call = stub.Generate(pb.GenerateRequest(request_id="r1", prompt="hi", sampling=LONG),
                                 metadata=bearer("key-a"))
            await call.read()
            by_other_tenant = await stub.Abort(pb.AbortRequest(request_ids=["r1"]), metadata=bearer("key-b"))
            # Another connection and another key of the same tenant: its request.
            async with grpc.aio.insecure_channel(f"127.0.0.1:{bound_port(server)}") as second:
                by_same_tenant = await pb_grpc.GenerationStub(second).Abort(
                    pb.AbortRequest(request_ids=["r1"]), metadata=bearer("key-a2"))
            return by_other_tenant, by_same_tenant, await rest_of(call)

    by_other_tenant, by_same_tenant, rest = asyncio.run(body())
    assert list(by_other_tenant.aborted_request_ids) == []
    assert list(by_same_tenant.aborted_request_ids) == ["r1"]
    assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT and backend.aborted == ["r1"]


def test_keys_from_the_environment(monkeypatch):
    monkeypatch.setenv(API_KEYS_ENV, "acme=k1, bobs=k2,")
    monkeypatch.setenv(AUTH_TOKEN_ENV, "k0")
    keys = api_keys_from_env()
    assert keys is not None
    assert keys.tenants == {"k1": "acme", "k2": "bobs", "k0": "default"}
    assert keys.tenant_of("Bearer k2") == "bobs" and keys.tenant_of("Bearer k3") is None
    assert keys.tenant_of("k1") is None  # the scheme is part of it
    monkeypatch.setenv(API_KEYS_ENV, "acme")
    with pytest.raises(ValueError, match="tenant=key"):
        api_keys_from_env()
    monkeypatch.delenv(API_KEYS_ENV)
    monkeypatch.delenv(AUTH_TOKEN_ENV)
    assert api_keys_from_env() is None
