"""The workers' KV block events into the router's index (router/kv_index.py): one ZMQ SUB
socket on the router's event loop, connected to every worker that publishes
(tandem/worker/kv_events_publisher.py). A batch the index cannot apply (the first one heard, a
gap, a restarted worker) has the worker's snapshot fetched, one at a time per worker; until it
lands the worker counts as holding nothing."""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from tandem.kvcache.kv_events import KVEventBatch
from tandem.router.kv_index import KVBlockIndex
from tandem.router.policy import WorkerState

logger = logging.getLogger(__name__)

RECHECK_S = 2.0
"""How often workers still without a snapshot are asked again."""


class KVEventFeed:
    def __init__(self, index: KVBlockIndex) -> None:
        self.index = index
        self._workers: dict[str, WorkerState] = {}
        self._addresses: dict[str, str] = {}
        self.tier_addresses: dict[str, str] = {}
        """Instance -> where it serves its pool's and disk tier's blocks to other workers (router/kv_sources.py)."""
        self._resyncing: set[str] = set()
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._socket.setsockopt(zmq.LINGER, 0)
        self._task: asyncio.Task | None = None
        self.num_malformed = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._receive(), name="kv-events-feed")

    async def subscribe(self, w: WorkerState) -> None:
        """Follow ``w``'s events (a worker that publishes none is left out)."""
        address = await w.handle.kv_events_address.remote()
        if address is None:
            return
        self._workers[w.instance] = w
        self._addresses[w.instance] = address
        await self._learn_tiers(w)
        self._socket.connect(address)
        self._resync(w.instance)  # (nothing was heard before the connection)

    def forget(self, w: WorkerState) -> None:
        self._workers.pop(w.instance, None)
        self.tier_addresses.pop(w.instance, None)
        address = self._addresses.pop(w.instance, None)
        if address is not None:
            self._socket.disconnect(address)
        self.index.forget(w.instance)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._socket.close()
        self._context.term()

    async def _receive(self) -> None:
        last_check = asyncio.get_running_loop().time()
        while True:
            now = asyncio.get_running_loop().time()
            if now - last_check >= RECHECK_S:  # a restarted worker publishes elsewhere, and a quiet one sends nothing
                last_check = now
                for instance in [i for i in self._workers if self.index.is_stale(i)]:
                    self._resync(instance)
            if not await self._socket.poll(timeout=int(RECHECK_S * 1000)):
                continue
            data = await self._socket.recv()
            try:
                batch = KVEventBatch.decode(data)
            except ValueError as e:
                self.num_malformed += 1
                logger.warning("kv events: dropped a malformed batch: %s", e)
                continue
            if batch.worker in self._workers and not self.index.apply(batch):
                self._resync(batch.worker)

    async def _learn_tiers(self, w: WorkerState) -> None:
        """Where ``w`` serves its blocks, and which disk folder it reads."""
        tier = await w.handle.kv_tier_address.remote()
        share_id = await w.handle.kv_disk_share_id.remote()
        if w.instance not in self._workers:
            return
        self.index.share_disk(w.instance, share_id)
        if tier is None:
            self.tier_addresses.pop(w.instance, None)
        else:
            self.tier_addresses[w.instance] = tier

    def _resync(self, instance: str) -> None:
        if instance in self._resyncing:
            return
        self._resyncing.add(instance)
        asyncio.get_running_loop().create_task(self._fetch_snapshot(instance))

    async def _fetch_snapshot(self, instance: str) -> None:
        try:
            w = self._workers.get(instance)
            if w is None:
                return
            address = await w.handle.kv_events_address.remote()
            if address != self._addresses.get(instance) and instance in self._workers:
                self._socket.disconnect(self._addresses[instance])
                self._addresses[instance] = address
                self._socket.connect(address)
                await self._learn_tiers(w)  # a restarted worker serves elsewhere too
            snap = await w.handle.kv_snapshot.remote()
            if snap is not None and instance in self._workers:
                holdings = {bytes.fromhex(h): tiers for h, tiers in snap["holdings"].items()}
                self.index.resync(instance, snap["epoch"], snap["seq"], holdings)
        except Exception as e:  # noqa: BLE001 - a worker down or restarting: its next batch asks again
            logger.info("kv events: no snapshot from %s: %s", instance, e)
        finally:
            self._resyncing.discard(instance)
