"""Bounded waits while a cluster starts: for Ray to place every worker (a placement group of
all their bundles, reserved and released at once), then for each worker to load its model.
Ray leaves an actor whose resources never come pending forever; these turn that into an
error that names what is missing, after a bound the operator chose."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from tandem.router.placement import Placement, PlacementError, amount

logger = logging.getLogger(__name__)


def _describe(resources: Mapping[str, float], names: Sequence[str]) -> str:
    return ", ".join(amount(resources.get(name, 0.0), name) for name in names)


async def wait_placeable(placement: Placement, timeout_s: float) -> None:
    """Wait until Ray can reserve every worker's resources at once (PACK: on as few nodes as
    it can, spread where it must), then release them for the workers to take; PlacementError
    after ``timeout_s``: the resources exist (check_fits passed) but are taken by others, or
    split across nodes or GPUs so that no worker fits."""
    bundles = [b for b in placement.bundles() if b]  # Ray refuses an empty bundle: nothing to wait for
    if not bundles:
        return
    group = placement_group(bundles, strategy="PACK")
    try:
        await asyncio.wait_for(group.ready(), timeout_s)
    except asyncio.TimeoutError:
        needs = placement.needs()
        names = sorted(needs)
        raise PlacementError(
            f"Ray could not place the workers within {timeout_s:g} s: they need {_describe(needs, names)} "
            f"({len(bundles)} ranks); the cluster has {_describe(ray.cluster_resources(), names)} in all, "
            f"{_describe(ray.available_resources(), names)} free now (taken by other jobs, or split across nodes "
            f"or GPUs so that a rank does not fit; --placement-timeout to wait longer)") from None
    finally:
        remove_placement_group(group)


async def wait_ready(workers: Mapping[str, Any], timeout_s: float) -> None:
    """Wait until every worker (instance name -> actor handle) has loaded its model;
    PlacementError naming those that have not after ``timeout_s`` (the caller stops them)."""
    pending = {asyncio.ensure_future(_ready(handle)): name for name, handle in workers.items()}
    if not pending:
        return
    done, late = await asyncio.wait(pending, timeout=timeout_s, return_when=asyncio.FIRST_EXCEPTION)
    for task in late:
        task.cancel()
    await asyncio.gather(*late, return_exceptions=True)
    for task in done:
        task.result()  # a worker that failed to start: its error
    if late:
        names = ", ".join(sorted(pending[t] for t in late))
        raise PlacementError(f"worker(s) {names} did not finish starting within {timeout_s:g} s (their resources "
                             "were placed: still loading the model, or restarting after a crash; see the Ray worker "
                             "logs; --start-timeout to wait longer)")


async def _ready(handle: Any) -> None:
    await handle.is_ready.remote()
