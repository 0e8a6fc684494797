"""A worker's KV block events on the wire: its event log cut every PUBLISH_EVERY_S into a
numbered batch, sent on a ZMQ PUB socket the router subscribes to (router/kv_events_feed.py),
and the snapshot that resyncs the router after a lost batch."""

from __future__ import annotations

import threading
import uuid

import zmq

from tandem.config.kv_transfer_config import NODE_IP, KVTransferConfig
from tandem.engine.engine import LLMEngine
from tandem.kvcache.kv_events import POOL_TIER, KVEventLog
from tandem.kvcache.prefix_tier import tiers_of

PUBLISH_EVERY_S = 0.02
"""Batching: a step's events go out together, at most this long after they happened."""


def events_host(kv_transfer: KVTransferConfig) -> str:
    """Where a worker publishes: the address its KV receiver listens on when one is set for
    its node (--kv-transfer-host, which a router on another node can reach), else loopback."""
    host = kv_transfer.receiver_host
    return "127.0.0.1" if host in (None, NODE_IP) else host


class KVEventPublisher:
    """Publishes ``engine``'s block events (its pool's and its tiers') as ``instance``."""

    def __init__(self, engine: LLMEngine, instance: str, host: str) -> None:
        self.log = KVEventLog(instance, uuid.uuid4().hex)
        engine.block_manager.events = self.log
        for tier in tiers_of(engine.block_manager.tier):
            tier.events = self.log
        self._stop = threading.Event()
        self._bound = threading.Event()
        self.address = ""
        """tcp://HOST:PORT, once started."""
        self._host = host
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        self._bound.wait()

    def _run(self) -> None:
        # NOTE: the socket lives on this thread alone (ZMQ sockets are not thread-safe).
        context = zmq.Context()
        socket = context.socket(zmq.PUB)
        socket.setsockopt(zmq.LINGER, 0)
        port = socket.bind_to_random_port(f"tcp://{self._host}")
        self.address = f"tcp://{self._host}:{port}"
        self._bound.set()
        try:
            while not self._stop.wait(PUBLISH_EVERY_S):
                batch = self.log.cut()
                if batch is not None:
                    socket.send(batch.encode())
        finally:
            socket.close()
            context.term()

    def snapshot(self, engine: LLMEngine) -> dict:
        """What the engine holds now, and the last batch it follows (call on the engine loop
        thread, between steps). The number is read first: every event of the batches up to it
        is in what follows; later ones the router applies on top, which leaves it unchanged."""
        seq = self.log.last_seq
        holdings: dict[str, list[str]] = {h.hex(): [POOL_TIER] for h in engine.block_manager.cached_block_ids}
        for tier in tiers_of(engine.block_manager.tier):
            for h in tier.block_hashes():
                holdings.setdefault(h.hex(), []).append(tier.name)
        return {"worker": self.log.worker, "epoch": self.log.epoch, "seq": seq, "holdings": holdings}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
