"""How a prefill or decode worker moves KV (kvtransfer/): frozen, built once by the router
(``tandem serve``'s --kv-* flags) and pickled to every worker actor, where the only values
that depend on the actor's node (its id, its address) are filled in before the worker is
built (:meth:`KVTransferConfig.on_node`). Torch-free, beneath everything else."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

NODE_IP = "node-ip"
"""``receiver_host`` for "this worker's Ray node's address", worked out on that node."""


@dataclass(frozen=True)
class KVTransferConfig:
    """The KV transfer settings of a prefill or decode worker (a colocated worker has none to use)."""

    transport: str = "auto"
    """How prefill workers send KV to decode workers (kvtransfer.connectors.registry.kv_transports(); auto:
    shared memory on one node, CUDA IPC on one GPU, else NCCL between GPUs, else ZMQ frames:
    kvtransfer/path_choice.py). Decode workers are told too: only auto needs their pools in
    shared memory, and zmq keeps a GPU pool unexported."""
    timeout_s: float = 30.0
    """A decode worker fails a reservation when nothing more of its KV arrives for this long
    after the latest layer message; a prefill worker fails a transfer when no ack comes this
    long after its latest layer sent."""
    checksum: bool = False
    """Prefill workers send a CRC-32 with every layer (--kv-checksum): corrupted KV fails its
    request instead of its output."""
    allow_unencrypted_pairs: bool = False
    """With TANDEM_KV_SECRET set, torch.distributed pairs (nccl, gloo: never encrypted) are taken
    all the same (--kv-allow-unencrypted-pairs); else refused (kvtransfer/path_choice.py)."""
    receiver_host: str | None = None
    """Where decode workers' KV receivers listen (--kv-transfer-host): an address, or NODE_IP
    (each worker's own Ray node's address, so that prefill workers on other hosts reach it);
    None: loopback (kvtransfer.receiver.DEFAULT_ADDRESS)."""
    node_id: str | None = None
    """The worker's node (Ray's node id): decode workers on the same one share their pools in
    place. None: the host's identity (kvtransfer.placement.host_identity)."""

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"the KV transfer timeout must be > 0 s, got {self.timeout_s:g}")

    def on_node(self, node_id: str, node_ip: str) -> KVTransferConfig:
        """These settings as a worker on the Ray node ``node_id`` (at ``node_ip``) runs them."""
        host = node_ip if self.receiver_host == NODE_IP else self.receiver_host
        return dataclasses.replace(self, node_id=node_id, receiver_host=host)

    @property
    def receiver_address(self) -> str | None:
        """The ZMQ address a decode worker's receiver binds (any free port on receiver_host);
        None: the receiver's default."""
        if self.receiver_host == NODE_IP:
            raise ValueError(f"receiver_host {NODE_IP!r} is known only on the worker's node: see on_node")
        return None if self.receiver_host is None else f"tcp://{self.receiver_host}:0"
