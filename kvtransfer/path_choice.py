"""Which data path a prefill worker's KV takes to one decode worker, decided from where the
two pools live: torch-free, so that the rule is one function a test can run over every input.

The paths, best first where they apply:
- shm: written in place into the receiver's pool, a file in the node's shared memory (both
  pools in host memory, one node);
- cuda_ipc: written in place, device to device, into the receiver's GPU pool opened by CUDA
  IPC (one node, one GPU; or two GPUs of a node with peer access);
- nccl (or gloo when asked for): a torch.distributed group of two (dist_pairs.py);
- zmq: frames over the socket (CurveZMQ-encrypted when TANDEM_KV_SECRET is set).

NOTE: never a torch.distributed pair between two pools that may share a GPU: NCCL refuses
two ranks on one device ("Duplicate GPU detected"). One GPU with two pools is the default
`tandem serve` on a one-GPU host (0.5 GPU per worker), so that pair shares by CUDA IPC.
NOTE: a pair is never encrypted (neither the rows nor its rendezvous): with the secret set
it is taken only when the operator acknowledged that (ALLOW_UNENCRYPTED_FLAG). The in-place
paths never leave the host, so they need no encryption.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.kvtransfer.connectors.registry import kv_transports

SHM, CUDA_IPC, NCCL, GLOO, ZMQ = "shm", "cuda_ipc", "nccl", "gloo", "zmq"
PATHS = (SHM, CUDA_IPC, NCCL, GLOO, ZMQ)
IN_PLACE_PATHS = (SHM, CUDA_IPC)
"""Written into the receiver's pool by the sender itself: the bytes never leave the host."""
PAIR_PATHS = (GLOO, NCCL)
"""torch.distributed pairs: not encrypted."""
DEVICE_TYPES = ("cpu", "cuda")
ALLOW_UNENCRYPTED_FLAG = "--kv-allow-unencrypted-pairs"


@dataclass(frozen=True)
class PoolPlace:
    """Where one worker's KV pool lives, as the chooser sees it."""

    node_id: str = ""
    """The worker's node (Ray's node id, else the host's identity); empty: unknown, never the same."""
    device_type: str = "cpu"
    """One of DEVICE_TYPES."""
    device: str = ""
    """The pool's CUDA device: its GPU's UUID, else "<node>/<index>" (cuda_ipc.device_identity);
    empty on the CPU, or unknown (then it may be any GPU of its node)."""

    @property
    def on_gpu(self) -> bool:
        return self.device_type == "cuda"


@dataclass(frozen=True)
class PairFacts:
    """Everything the choice depends on, for one sender and one receiver."""

    sender: PoolPlace
    receiver: PoolPlace
    receiver_shared: bool
    """The receiver offers its pool to be written in place: a file in shared memory for a
    pool in host memory, a CUDA IPC export for one on a GPU (Destination.shm_pool)."""
    can_peer_access: bool
    """The sender's GPU can write the receiver's GPU directly (two devices of one node)."""
    transport: str = "auto"
    """What the operator asked for (registry.kv_transports())."""
    has_secret: bool = False
    """TANDEM_KV_SECRET is set: the KV must not cross a network unencrypted."""
    allow_unencrypted_pairs: bool = False
    """The operator acknowledged unencrypted torch.distributed pairs (ALLOW_UNENCRYPTED_FLAG)."""


@dataclass(frozen=True)
class PathChoice:
    """The path for a pair, and why (for the log line that announces it)."""

    path: str
    """One of PATHS; empty when the pair is refused."""
    reason: str

    @property
    def refused(self) -> bool:
        return not self.path


def may_share_device(facts: PairFacts) -> bool:
    """Whether both pools are, or may be, on one GPU: the same known device, or a device
    unknown on either side with both (possibly) on one node."""
    s, r = facts.sender, facts.receiver
    if not (s.on_gpu and r.on_gpu):
        return False
    if s.device and r.device:
        return s.device == r.device
    return not s.node_id or not r.node_id or s.node_id == r.node_id


def _in_place(facts: PairFacts) -> PathChoice | None:
    """The in-place path the pair can take, if any."""
    s, r = facts.sender, facts.receiver
    if not (s.node_id and s.node_id == r.node_id and facts.receiver_shared):
        return None
    if not s.on_gpu and not r.on_gpu:
        # NOTE: only auto: an explicit gloo or nccl is a request to exercise that transport.
        return PathChoice(SHM, "same node, the receiver's pool in shared memory") if facts.transport == "auto" else None
    if not (s.on_gpu and r.on_gpu and s.device and r.device):
        return None
    if s.device == r.device:  # whatever was asked for: no pair can be made on one GPU
        asked = "" if facts.transport == "auto" else f"; {facts.transport} asked for, but NCCL allows one rank per GPU"
        return PathChoice(CUDA_IPC, f"both pools on one GPU ({s.device}){asked}")
    if facts.can_peer_access and facts.transport == "auto":
        return PathChoice(CUDA_IPC, f"GPU {s.device} writes GPU {r.device} by peer access")
    return None


def _unencrypted_pair_refused(facts: PairFacts) -> bool:
    return facts.has_secret and not facts.allow_unencrypted_pairs


def choose_path(facts: PairFacts) -> PathChoice:
    """The data path for a pair: a registered connector's name (ValueError for a transport
    not in registry.kv_transports()). A selectable connector beyond the built-in ones is
    taken when asked for (its receiver may still decline it: frames then); auto never
    takes it, until a rule here says when it is the best."""
    transport = facts.transport
    if transport not in kv_transports():
        raise ValueError(f"transport must be one of {kv_transports()}, got {transport!r}")
    if transport not in ("auto", *PATHS):
        return PathChoice(transport, f"{transport} asked for")
    if transport == ZMQ:
        return PathChoice(ZMQ, "zmq asked for")
    in_place = _in_place(facts)
    if in_place is not None:
        return in_place
    s, r = facts.sender, facts.receiver
    if transport in PAIR_PATHS:
        if may_share_device(facts):
            return PathChoice("", f"--kv-transport {transport}: both pools may be on one GPU, where NCCL allows one "
                                  "rank per device, and the receiver's pool cannot be shared by CUDA IPC with this "
                                  "sender; use --kv-transport auto (or zmq)")
        if transport == NCCL and not (s.on_gpu and r.on_gpu):
            return PathChoice("", "--kv-transport nccl: NCCL needs both pools on CUDA devices "
                                  f"(the sender's is on {s.device_type}, the receiver's on {r.device_type})")
        if _unencrypted_pair_refused(facts):
            return PathChoice("", f"--kv-transport {transport}: a torch.distributed pair is not encrypted and "
                                  f"TANDEM_KV_SECRET is set; pass {ALLOW_UNENCRYPTED_FLAG} to send the KV "
                                  "unencrypted anyway, or use auto or zmq (CurveZMQ-encrypted frames)")
        return PathChoice(transport, f"{transport} asked for")
    if s.on_gpu and r.on_gpu:
        if may_share_device(facts):
            return PathChoice(ZMQ, "both pools may be on one GPU and the receiver's pool is not shared by CUDA IPC "
                                   "with this sender (no NCCL pair on one device)")
        if _unencrypted_pair_refused(facts):
            return PathChoice(ZMQ, "two GPUs, but TANDEM_KV_SECRET is set and an NCCL pair is not encrypted: "
                                   f"CurveZMQ frames ({ALLOW_UNENCRYPTED_FLAG} allows NCCL)")
        return PathChoice(NCCL, "two GPU pools on different devices")
    if not s.node_id or s.node_id != r.node_id:
        return PathChoice(ZMQ, "the receiver is on another node")
    return PathChoice(ZMQ, "the receiver's pool is private" if not facts.receiver_shared
                      else "the two pools are not both in host memory")
