"""What a sender knows of a pair, for path_choice: where its own pool lives, where the
receiver's does (from its Destination), and, only where it can matter, whether the two GPUs
reach each other by peer access (a question for CUDA, kept out of the torch-free chooser)."""

from __future__ import annotations

import torch

from tandem.kvtransfer.cuda_ipc import can_peer_access
from tandem.kvtransfer.path_choice import DEVICE_TYPES, PairFacts, PoolPlace
from tandem.kvtransfer.protocol import Destination


def pair_facts(pool_device: torch.device, node_id: str, device: str, destination: Destination | None,
               transport: str, has_secret: bool, allow_unencrypted_pairs: bool) -> PairFacts:
    """pool_device: the sender's pool's torch device; node_id, device: its node and device
    identity (cuda_ipc.device_identity; empty on the CPU); destination: one of the receiver's
    (None: a receiver known by address alone)."""
    sender = PoolPlace(node_id, pool_device.type if pool_device.type in DEVICE_TYPES else "cpu", device)
    if destination is None:
        return PairFacts(sender, PoolPlace(), False, False, transport, has_secret, allow_unencrypted_pairs)
    receiver = PoolPlace(destination.node_id, "cuda" if destination.device else "cpu", destination.device)
    shared = bool(destination.shm_pool)
    # Asked of CUDA only where it can matter: two GPUs of one node.
    peer_access = (shared and transport == "auto" and sender.on_gpu and receiver.on_gpu and bool(node_id)
                   and destination.node_id == node_id and destination.device != device
                   and can_peer_access(pool_device, destination.device, node_id))
    return PairFacts(sender, receiver, shared, peer_access, transport, has_secret, allow_unencrypted_pairs)
