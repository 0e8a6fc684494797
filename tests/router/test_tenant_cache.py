"""With API keys each tenant's prefix cache is its own: the salt the workers see is made from
the tenant and the salt it sent, through both front doors. Without keys, salts pass unchanged."""

from __future__ import annotations

import asyncio

from fake_backend import FakeBackend
from openai_harness import MODEL, openai_serving
from router_harness import serving

from tandem.proto import generation_pb2 as pb
from tandem.proto import generation_pb2_grpc as pb_grpc
from tandem.router.auth import ApiKeys

KEYS = ApiKeys({"key-a": "acme", "key-a2": "acme", "key-b": "bobs"})
# (key, the salt the client sends): acme twice with no salt, by two keys; bobs without one,
# then sending salt "s", and acme sending "s" too.
CALLS = [("key-a", None), ("key-a2", None), ("key-b", None), ("key-b", "s"), ("key-a", "s")]


def check_salts(seen: list[str | None]) -> None:
    acme_plain, acme_plain_again, bobs_plain, bobs_s, acme_s = seen
    assert acme_plain == acme_plain_again  # one tenant, one cache, whichever of its keys
    assert len({acme_plain, bobs_plain, bobs_s, acme_s}) == 4  # same salt "s", two tenants: two caches
    assert all(isinstance(s, str) and len(s) == 32 for s in seen) and "s" not in seen


def grpc_salts(router_tokenizer, keys: ApiKeys | None) -> list[str | None]:
    backend = FakeBackend(router_tokenizer)

    async def body():
        async with serving(backend, auth_token=keys) as (channel, _):
            stub = pb_grpc.GenerationStub(channel)
            for key, salt in CALLS:
                request = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=2, cache_salt=salt))
                async for _ in stub.Generate(request, metadata=(("authorization", f"Bearer {key}"),)):
                    pass

    asyncio.run(body())
    return [s.params.cache_salt for s in backend.seen]


def test_grpc_tenants_get_their_own_salts(router_tokenizer):
    check_salts(grpc_salts(router_tokenizer, KEYS))


def test_without_keys_the_salt_is_the_clients(router_tokenizer):
    assert grpc_salts(router_tokenizer, None) == [salt for _, salt in CALLS]


def test_openai_tenants_get_their_own_salts(router_tokenizer):
    backend = FakeBackend(router_tokenizer)

    async def body():
        async with openai_serving(backend, auth_token=KEYS) as served:
            for key, salt in CALLS:
                async with served.async_client(api_key=key) as client:
                    await client.completions.create(model=MODEL, prompt="hi", max_tokens=2,
                                                    extra_body={} if salt is None else {"cache_salt": salt})

    asyncio.run(body())
    check_salts([s.params.cache_salt for s in backend.seen])
