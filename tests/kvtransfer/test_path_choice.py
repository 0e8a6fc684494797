"""The KV data path chooser (kvtransfer/path_choice.py) over every input it takes: never a
torch.distributed pair between two pools on one GPU, never an unencrypted pair with the
secret set unless acknowledged; the default `tandem serve` on a one-GPU host takes CUDA IPC;
and the sender asks the handshake for what the chooser says (defect 1 of issue 30: auto
used to pair two pools on cuda:0 by NCCL, which NCCL refuses)."""

from __future__ import annotations

import dataclasses
import itertools
import types
from typing import cast

import pytest
import torch

import tandem.kvtransfer.sender as sender_module
from tandem.kvtransfer.connectors.base import KVConnector
from tandem.kvtransfer.connectors.registry import kv_transports
from tandem.kvtransfer.curve import CurveKeys
from tandem.kvtransfer.path_choice import (
    ALLOW_UNENCRYPTED_FLAG,
    CUDA_IPC,
    DEVICE_TYPES,
    IN_PLACE_PATHS,
    NCCL,
    PAIR_PATHS,
    PATHS,
    SHM,
    ZMQ,
    PairFacts,
    PoolPlace,
    choose_path,
)
from tandem.kvtransfer.protocol import Destination, TransferRefused
from tandem.kvtransfer.sender import KVSender
from tandem.router.placement import Placement, Pool, gpus_per_rank

NODES = ("", "node-a", "node-b")
DEVICES = ("", "GPU-1111", "GPU-2222")
BOOLS = (False, True)


def every_facts():
    places = [PoolPlace(n, t, d) for n, t, d in itertools.product(NODES, DEVICE_TYPES, DEVICES)
              if (t == "cuda") or not d]  # a pool in host memory has no device identity
    for sender, receiver, shared, peer, transport, secret, allow in itertools.product(
            places, places, BOOLS, BOOLS, kv_transports(), BOOLS, BOOLS):
        yield PairFacts(sender, receiver, shared, peer, transport, secret, allow)


def test_no_input_pairs_two_pools_on_one_gpu_or_leaks_the_kv():
    num_facts = 0
    for facts in every_facts():
        num_facts += 1
        choice = choose_path(facts)
        s, r = facts.sender, facts.receiver
        assert choice.path in (*PATHS, "") and choice.reason, facts
        if choice.path in PAIR_PATHS:  # never on one GPU, nor where it may be one (a device unknown, one node)
            same_node = not s.node_id or not r.node_id or s.node_id == r.node_id
            assert not (s.on_gpu and r.on_gpu and (s.device and s.device == r.device or not s.device and same_node
                                                    or not r.device and same_node)), facts
            assert facts.transport in (choice.path, "auto"), facts
            assert not facts.has_secret or facts.allow_unencrypted_pairs, facts
        if choice.path in IN_PLACE_PATHS:  # one node, a pool offered in place
            assert s.node_id and s.node_id == r.node_id and facts.receiver_shared, facts
        if choice.path == SHM:
            assert not s.on_gpu and not r.on_gpu and facts.transport == "auto", facts
        if choice.path == CUDA_IPC:
            assert s.on_gpu and r.on_gpu and s.device and (s.device == r.device or facts.can_peer_access), facts
        if facts.transport == ZMQ:
            assert choice.path == ZMQ, facts
        if choice.refused:
            assert facts.transport in PAIR_PATHS, facts
    assert num_facts == (len(NODES) * (1 + len(DEVICES))) ** 2 * 2 * 2 * len(kv_transports()) * 2 * 2


def gpu(node: str, device: str) -> PoolPlace:
    return PoolPlace(node, "cuda", device)


CPU_A = PoolPlace("node-a", "cpu")


@pytest.mark.parametrize("facts, path, reason", [
    (PairFacts(CPU_A, CPU_A, True, False), SHM, "same node, the receiver's pool in shared memory"),
    (PairFacts(CPU_A, CPU_A, False, False), ZMQ, "the receiver's pool is private"),
    (PairFacts(CPU_A, PoolPlace("node-b"), True, False), ZMQ, "the receiver is on another node"),
    (PairFacts(gpu("node-a", "GPU-1"), gpu("node-a", "GPU-1"), True, False), CUDA_IPC, "both pools on one GPU (GPU-1)"),
    (PairFacts(gpu("node-a", "GPU-1"), gpu("node-a", "GPU-1"), True, False, "nccl"), CUDA_IPC,
     "both pools on one GPU (GPU-1); nccl asked for, but NCCL allows one rank per GPU"),
    (PairFacts(gpu("node-a", "GPU-1"), gpu("node-a", "GPU-2"), True, True), CUDA_IPC,
     "GPU GPU-1 writes GPU GPU-2 by peer access"),
    (PairFacts(gpu("node-a", "GPU-1"), gpu("node-a", "GPU-2"), True, False), NCCL,
     "two GPU pools on different devices"),
    (PairFacts(gpu("node-a", "GPU-1"), gpu("node-b", "GPU-2"), False, False), NCCL,
     "two GPU pools on different devices"),
    (PairFacts(gpu("node-a", "GPU-1"), gpu("node-a", "GPU-1"), False, False), ZMQ,
     "both pools may be on one GPU and the receiver's pool is not shared by CUDA IPC with this sender "
     "(no NCCL pair on one device)"),
    (PairFacts(gpu("node-a", "GPU-1"), gpu("node-b", "GPU-2"), False, False, has_secret=True), ZMQ,
     f"two GPUs, but TANDEM_KV_SECRET is set and an NCCL pair is not encrypted: CurveZMQ frames "
     f"({ALLOW_UNENCRYPTED_FLAG} allows NCCL)"),
    (PairFacts(gpu("node-a", "GPU-1"), gpu("node-b", "GPU-2"), False, False, "nccl", True, True), NCCL,
     "nccl asked for"),
    (PairFacts(gpu("node-a", "GPU-1"), gpu("node-a", "GPU-1"), True, False, "zmq", True), ZMQ, "zmq asked for"),
])
def test_main_cases(facts: PairFacts, path: str, reason: str):
    assert choose_path(facts) == (choose_path(facts).__class__(path, reason))


def test_refusals_say_what_to_do():
    secret_nccl = PairFacts(gpu("node-a", "GPU-1"), gpu("node-b", "GPU-2"), False, False, "nccl", has_secret=True)
    assert choose_path(secret_nccl).refused and ALLOW_UNENCRYPTED_FLAG in choose_path(secret_nccl).reason
    one_gpu = PairFacts(gpu("node-a", "GPU-1"), gpu("node-a", "GPU-1"), False, False, "nccl")
    assert choose_path(one_gpu).refused and "one GPU" in choose_path(one_gpu).reason
    on_host = PairFacts(CPU_A, CPU_A, False, False, "nccl")
    assert choose_path(on_host).reason.startswith("--kv-transport nccl: NCCL needs both pools on CUDA devices")
    with pytest.raises(ValueError, match="transport"):
        choose_path(dataclasses.replace(on_host, transport="rdma"))


def test_default_serve_on_one_gpu_puts_both_workers_on_it_and_shares_by_ipc():
    share = gpus_per_rank(None, "auto", cluster_gpus=1.0, num_ranks=2)
    placement = Placement((Pool("prefill", 1), Pool("decode", 1)), 1.0, share)
    assert share == 0.5 and placement.needs()["GPU"] == 1.0  # both on the one GPU
    placement.check_fits({"CPU": 2.0, "GPU": 1.0}, "the cluster")
    # Ray shows each worker the one GPU: the same UUID on both sides of the pair.
    one_gpu = gpu("node-a", "GPU-1111")
    assert choose_path(PairFacts(one_gpu, one_gpu, True, False)).path == CUDA_IPC


def sender_on_gpu(transport: str, secret: bool = False) -> KVSender:
    sender = KVSender(torch.zeros(2, 2, 4, 4, 2, 8), transport=transport, node_id="node-a")
    # The prefill pool on GPU 0: all the handshake reads of it is its device (no GPU here).
    sender.kv_cache = cast(torch.Tensor, types.SimpleNamespace(device=torch.device("cuda", 0)))
    sender.device = "GPU-1111"
    sender.curve = cast(CurveKeys, object()) if secret else None  # (only its presence is read before the handshake)
    return sender


def asked_of_handshake(sender: KVSender, dest: Destination, monkeypatch: pytest.MonkeyPatch) -> dict:
    """-> what the sender's handshake would ask the receiver for: the connector and the HELLO."""
    asked: dict = {}

    def connect_peer(address: str, hello: dict, timeout_s: float, connector: KVConnector, curve: object) -> None:
        asked.update(path=connector.name, connector=connector, hello=hello, curve=curve)
    monkeypatch.setattr(sender_module, "connect_peer", connect_peer)
    sender.handshake(dest.address, destination=dest)
    return asked


ON_ITS_GPU = Destination("r", "tcp://127.0.0.1:1", (0,), 3, node_id="node-a", shm_pool="tandem-kv-1-2-" + "0" * 32,
                         device="GPU-1111")


@pytest.mark.parametrize("transport", ["auto", "nccl", "gloo"])
def test_the_sender_never_pairs_with_a_pool_on_its_gpu(transport: str, monkeypatch: pytest.MonkeyPatch):
    asked = asked_of_handshake(sender_on_gpu(transport), ON_ITS_GPU, monkeypatch)
    assert asked["path"] == "cuda_ipc" and asked["connector"].side.destination.shm_pool == ON_ITS_GPU.shm_pool
    assert asked["connector"].offer() == {"in_place": "cuda_ipc", "peer_access": False}
    assert asked["hello"]["device"] == "GPU-1111"  # the receiver refuses a pair from its own GPU too
    private = dataclasses.replace(ON_ITS_GPU, shm_pool="")
    if transport == "auto":  # no IPC export: frames, not NCCL
        frames = asked_of_handshake(sender_on_gpu(transport), private, monkeypatch)
        assert frames["path"] == "zmq" and frames["connector"].hello() == {} and frames["hello"] == asked["hello"]
    else:
        with pytest.raises(TransferRefused, match="one GPU"):
            asked_of_handshake(sender_on_gpu(transport), private, monkeypatch)


def test_the_sender_refuses_an_unencrypted_pair_with_the_secret(monkeypatch: pytest.MonkeyPatch):
    other_node = Destination("r", "tcp://127.0.0.1:1", (0,), 3, node_id="node-b", device="GPU-2222")
    with pytest.raises(TransferRefused, match=ALLOW_UNENCRYPTED_FLAG):
        asked_of_handshake(sender_on_gpu("nccl", secret=True), other_node, monkeypatch)
    assert asked_of_handshake(sender_on_gpu("auto", secret=True), other_node, monkeypatch)["path"] == "zmq"
    allowed = sender_on_gpu("auto", secret=True)
    allowed.allow_unencrypted_pairs = True
    asked = asked_of_handshake(allowed, other_node, monkeypatch)
    assert asked["path"] == NCCL and asked["connector"].hello() == {"dist_pair": NCCL, "dist_required": False}


def test_serve_refuses_an_unacknowledged_pair_with_the_secret():
    import argparse

    from tandem.router import serve_command

    parser = argparse.ArgumentParser()
    serve_command.add_args(parser)
    secret = {"TANDEM_KV_SECRET": "a-secret-of-16-chars"}
    with pytest.raises(ValueError, match=f"--kv-transport nccl sends KV unencrypted.*{ALLOW_UNENCRYPTED_FLAG}"):
        serve_command.check_kv_encryption(parser.parse_args(["--kv-transport", "nccl"]), secret)
    serve_command.check_kv_encryption(parser.parse_args(["--kv-transport", "nccl", ALLOW_UNENCRYPTED_FLAG]), secret)
    serve_command.check_kv_encryption(parser.parse_args(["--kv-transport", "nccl"]), {})
    serve_command.check_kv_encryption(parser.parse_args([]), secret)  # auto: encrypted frames between GPUs
