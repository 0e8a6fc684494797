"""A stand-in for the router's PoolChanges that records each call (the real one needs Ray
actors): what the admin routes' tests (test_admin_routes.py, test_node_command.py) check
the routes ask for."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.router.pool_changes import DrainResult
from tandem.worker.api import Role

ADMIN_KEY = "admin-key"


@dataclass
class RecordedChanges:
    """PoolChanges' interface, recording each call (the real one needs Ray actors)."""

    calls: list[tuple[Any, ...]] = field(default_factory=list)

    def describe(self) -> list[dict[str, object]]:
        return [{"role": "decode", "instance": "decode-0", "healthy": True, "draining": False}]

    async def drain(self, instance: str, timeout_s: float) -> DrainResult:
        self.calls.append(("drain", instance, timeout_s))
        if instance == "nobody":
            raise ValueError("no worker is named 'nobody'")
        return DrainResult(instance, 3, 1, 0.5)

    async def replace(self, instance: str, timeout_s: float) -> list[str]:
        self.calls.append(("replace", instance, timeout_s))
        return ["added decode-2", f"drained {instance}"]

    async def drain_node(self, node_ip: str, timeout_s: float, replace: bool) -> list[str]:
        self.calls.append(("drain_node", node_ip, timeout_s, replace))
        return ["drained decode-0"]

    async def restart(self, names: list[str] | None, timeout_s: float) -> list[str]:
        self.calls.append(("restart", names, timeout_s))
        return ["added decode-2", "drained decode-0"]

    async def scale(self, sizes: dict[Role, int], timeout_s: float) -> list[str]:
        self.calls.append(("scale", sizes, timeout_s))
        return ["added decode-2"]
