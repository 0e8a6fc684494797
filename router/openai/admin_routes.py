"""The router's admin routes on the API port, behind the admin key (router/openai/app.py):
``GET /admin/workers`` (each worker: pool, name, healthy, draining), ``POST /admin/drain``
(``{"worker": name}`` or ``{"node_ip": address}``, with optional ``"timeout_s": 60`` and
``"replace": true``: take workers out without failing what they hold), ``POST /admin/scale``
(``{"prefill": N, "decode": M}`` or ``{"colocated": K}``, with an optional ``drain_timeout_s``)
and ``POST /admin/restart`` (``{"workers": [names]}``, default every worker: each replaced in
turn), answered once the change is done (router/pool_changes.py)."""

from __future__ import annotations

import math
from typing import Any

from aiohttp import web

from tandem.router.openai.errors import APIError, invalid
from tandem.router.openai.fields import json_kind
from tandem.router.openai.utility_routes import json_body
from tandem.router.pool_changes import DEFAULT_DRAIN_TIMEOUT_S, PoolChanges
from tandem.worker.api import Role

ADMIN_PREFIX = "/admin/"


def add_admin_routes(app: web.Application, changes: PoolChanges | None) -> None:
    def needed() -> PoolChanges:
        if changes is None:
            raise APIError(501, "this router cannot change its workers (it was given them)", type="server_error")
        return changes

    async def workers(request: web.Request) -> web.Response:
        return web.json_response({"workers": needed().describe()})

    async def drain(request: web.Request) -> web.Response:
        pools = needed()
        body = await json_body(request)
        name, node_ip, replace = body.get("worker"), body.get("node_ip"), body.get("replace", False)
        if (name is None) == (node_ip is None):
            raise invalid(None, "give one of worker (a worker's name) and node_ip (a Ray node's address)")
        if not isinstance(replace, bool):
            raise invalid("replace", f"must be a boolean, got {json_kind(replace)}")
        timeout_s = _seconds(body, "timeout_s")
        try:
            if node_ip is not None:
                if not isinstance(node_ip, str) or not node_ip:
                    raise invalid("node_ip", f"must be a node's address, got {json_kind(node_ip)}")
                return web.json_response({"changes": await pools.drain_node(node_ip, timeout_s, replace)})
            if not isinstance(name, str) or not name:
                raise invalid("worker", f"must be a worker's name, got {json_kind(name)}")
            if replace:
                return web.json_response({"changes": await pools.replace(name, timeout_s)})
            result = await pools.drain(name, timeout_s)
        except ValueError as e:
            raise invalid("worker", str(e)) from None
        return web.json_response({"instance": result.instance, "num_at_start": result.num_at_start,
                                  "num_moved": result.num_moved, "seconds": round(result.seconds, 3)})

    async def restart(request: web.Request) -> web.Response:
        pools = needed()
        body = await json_body(request)
        names = body.get("workers")
        if names is not None and (not isinstance(names, list) or not all(isinstance(n, str) for n in names)):
            raise invalid("workers", f"must be a list of workers' names, got {json_kind(names)}")
        try:
            done = await pools.restart(names, _seconds(body, "drain_timeout_s"))
        except ValueError as e:
            raise invalid("workers", str(e)) from None
        return web.json_response({"changes": done, "workers": pools.describe()})

    async def scale(request: web.Request) -> web.Response:
        pools = needed()
        body = await json_body(request)
        sizes: dict[Role, int] = {}
        for role in Role:
            size = body.get(role.value)
            if size is None:
                continue
            if type(size) is not int or size < 1:
                raise invalid(role.value, f"must be an integer >= 1, got {size!r}")
            sizes[role] = size
        if not sizes:
            raise invalid(None, "give the size of at least one pool: prefill, decode or colocated")
        try:
            done = await pools.scale(sizes, _seconds(body, "drain_timeout_s"))
        except ValueError as e:
            raise invalid(None, str(e)) from None
        return web.json_response({"changes": done, "workers": pools.describe()})

    app.router.add_get("/admin/workers", workers)
    app.router.add_post("/admin/drain", drain)
    app.router.add_post("/admin/scale", scale)
    app.router.add_post("/admin/restart", restart)


def _seconds(body: dict[str, Any], name: str) -> float:
    value = body.get(name, DEFAULT_DRAIN_TIMEOUT_S)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise invalid(name, f"must be a number of seconds >= 0, got {value!r}")
    return float(value)
