"""The admin routes' keys and bodies: only the admin key changes the cluster's workers (a
tenant's API key gets 403), each body is checked before anything changes (400 naming the
field), and each route asks the pool changes for what its body says. What the changes do on
a real cluster is tests/cluster/test_pool_changes_cluster.py's."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from fake_backend import FakeBackend
from openai_harness import openai_serving
from recorded_changes import ADMIN_KEY, RecordedChanges

from tandem.router.auth import ADMIN_API_KEY_ENV, API_KEYS_ENV, AUTH_TOKEN_ENV, ApiKeys, admin_key_from_env
from tandem.worker.api import Role

TENANT_KEY = "tenant-key"


def call(router_tokenizer, requests: list[tuple[str, str, Any, str | None]], *, keys: ApiKeys | None = None,
         admin_key: str | None = None) -> tuple[list[tuple[int, Any]], RecordedChanges]:
    """Each (method, path, json body, bearer key) in turn -> [(status, answer JSON)], the calls made."""
    backend = FakeBackend(router_tokenizer)
    changes = RecordedChanges()
    backend.pool_changes = changes  # type: ignore[attr-defined]

    async def body() -> list[tuple[int, Any]]:
        answers = []
        async with openai_serving(backend, auth_token=keys, admin_key=admin_key) as served, \
                aiohttp.ClientSession() as session:
            for method, path, json_body, key in requests:
                headers = {"Authorization": f"Bearer {key}"} if key else {}
                async with session.request(method, served.root + path, json=json_body, headers=headers) as r:
                    answers.append((r.status, await r.json()))
        return answers

    return asyncio.run(body()), changes


def error_code(answer: Any) -> str:
    return answer["error"]["code"]


def test_only_the_admin_key_changes_workers(router_tokenizer):
    keys = ApiKeys({TENANT_KEY: "acme"})
    answers, changes = call(router_tokenizer, [
        ("GET", "/admin/workers", None, TENANT_KEY),
        ("POST", "/admin/drain", {"worker": "decode-0"}, TENANT_KEY),
        ("POST", "/admin/drain", {"worker": "decode-0"}, None),
        ("POST", "/admin/drain", {"worker": "decode-0"}, "wrong"),
        ("GET", "/v1/models", None, ADMIN_KEY),  # the admin key is no tenant's key
        ("GET", "/admin/workers", None, ADMIN_KEY),
        ("GET", "/v1/models", None, TENANT_KEY),
    ], keys=keys, admin_key=ADMIN_KEY)
    assert [status for status, _ in answers] == [403, 403, 401, 401, 401, 200, 200]
    assert error_code(answers[0][1]) == error_code(answers[1][1]) == "not_admin_key"
    assert answers[5][1]["workers"][0]["instance"] == "decode-0"
    assert changes.calls == []


def test_tenant_keys_without_an_admin_key_turn_the_admin_routes_off(router_tokenizer):
    answers, changes = call(router_tokenizer, [("POST", "/admin/scale", {"decode": 2}, TENANT_KEY)],
                            keys=ApiKeys({TENANT_KEY: "acme"}))
    assert answers[0][0] == 403 and error_code(answers[0][1]) == "admin_key_not_set"
    assert "--admin-api-key" in answers[0][1]["error"]["message"]
    assert changes.calls == []


def test_a_router_without_keys_has_open_admin_routes(router_tokenizer):
    answers, changes = call(router_tokenizer, [("POST", "/admin/drain", {"worker": "decode-1", "timeout_s": 5}, None)])
    assert answers == [(200, {"instance": "decode-1", "num_at_start": 3, "num_moved": 1, "seconds": 0.5})]
    assert changes.calls == [("drain", "decode-1", 5.0)]


def test_each_route_asks_for_what_its_body_says(router_tokenizer):
    answers, changes = call(router_tokenizer, [
        ("POST", "/admin/drain", {"worker": "decode-0", "replace": True}, ADMIN_KEY),
        ("POST", "/admin/drain", {"node_ip": "10.0.0.7", "replace": True, "timeout_s": 30}, ADMIN_KEY),
        ("POST", "/admin/drain", {"node_ip": "10.0.0.8"}, ADMIN_KEY),
        ("POST", "/admin/restart", {}, ADMIN_KEY),
        ("POST", "/admin/restart", {"workers": ["decode-0"], "drain_timeout_s": 2.5}, ADMIN_KEY),
        ("POST", "/admin/scale", {"prefill": 1, "decode": 3}, ADMIN_KEY),
    ], admin_key=ADMIN_KEY)
    assert [status for status, _ in answers] == [200] * 6
    assert answers[0][1] == {"changes": ["added decode-2", "drained decode-0"]}
    assert changes.calls == [
        ("replace", "decode-0", 60.0),
        ("drain_node", "10.0.0.7", 30.0, True),
        ("drain_node", "10.0.0.8", 60.0, False),
        ("restart", None, 60.0),
        ("restart", ["decode-0"], 2.5),
        ("scale", {Role.PREFILL: 1, Role.DECODE: 3}, 60.0),
    ]


@pytest.mark.parametrize("path, body, field_name", [
    ("/admin/drain", {}, None),
    ("/admin/drain", {"worker": "decode-0", "node_ip": "10.0.0.7"}, None),
    ("/admin/drain", {"worker": 7}, "worker"),
    ("/admin/drain", {"node_ip": ""}, "node_ip"),
    ("/admin/drain", {"worker": "decode-0", "replace": "yes"}, "replace"),
    ("/admin/drain", {"worker": "decode-0", "timeout_s": -1}, "timeout_s"),
    ("/admin/drain", {"worker": "nobody"}, "worker"),
    ("/admin/restart", {"workers": "decode-0"}, "workers"),
    ("/admin/scale", {"decode": 0}, "decode"),
    ("/admin/scale", {}, None),
])
def test_a_bad_body_is_a_400_naming_its_field(router_tokenizer, path, body, field_name):
    answers, changes = call(router_tokenizer, [("POST", path, body, ADMIN_KEY)], admin_key=ADMIN_KEY)
    status, answer = answers[0]
    assert status == 400 and answer["error"]["param"] == field_name, answer
    assert changes.calls == ([("drain", "nobody", 60.0)] if body == {"worker": "nobody"} else [])


def test_the_admin_key_is_the_operators_never_a_tenants(monkeypatch):
    """--admin-api-key, else $TANDEM_ADMIN_API_KEY, else the operator's own --api-key (or
    $TANDEM_AUTH_TOKEN); the tenants' keys in $TANDEM_API_KEYS never."""
    for name in (ADMIN_API_KEY_ENV, AUTH_TOKEN_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(API_KEYS_ENV, "acme=tenant-key")
    assert admin_key_from_env() is None
    monkeypatch.setenv(AUTH_TOKEN_ENV, "operator-token")
    assert admin_key_from_env() == "operator-token"
    assert admin_key_from_env(api_key="operator-key") == "operator-key"
    monkeypatch.setenv(ADMIN_API_KEY_ENV, "env-admin")
    assert admin_key_from_env(api_key="operator-key") == "env-admin"
    assert admin_key_from_env("flag-admin", "operator-key") == "flag-admin"
