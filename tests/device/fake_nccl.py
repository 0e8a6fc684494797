"""A test-only torch.distributed backend, "fake_nccl", that plays NCCL by its documented rules
on this CPU-only machine, over fake CUDA tensors (FakeTensorMode: device and shape, no data).

What it enforces, as NCCL and torch's ProcessGroupNCCL do:
- CUDA tensors only: a CPU tensor raises ValueError("Tensors must be CUDA and dense").
- One rank per device: ranks of one communicator on the same device of one host fail the
  communicator's initialisation with NCCL's ncclInvalidUsage text ("Duplicate GPU detected :
  rank 1 and rank 0 both on CUDA device 1000"). The communicator is made when the group is
  built (as torch does for a group bound to its device, which dist_pairs asks for).
- `Work.wait()` returns at once and never raises, whatever the peer does (NCCL's only
  orders the current stream); `is_completed()` turns True only once the matching operation
  of the peer has arrived (a send: once the peer's recv took it).
- A watchdog: a work still incomplete past the group's timeout ends the process
  (os._exit(WATCHDOG_EXIT), as TORCH_NCCL_ASYNC_ERROR_HANDLING does), unless the group was
  aborted first. `abort()` and `shutdown()` end the communicator at once.
- Collectives (allreduce, broadcast, gather, barrier: what a tensor-parallel step uses)
  complete once every rank posted the same one (same op, root, dtype and shape, in the same
  order); ranks that disagree never complete, so the watchdog ends them (NCCL hangs there).
- A process-wide count of live communicators (`live_communicators`): built and not yet
  aborted or shut down. NOTE: stricter than torch, whose destructor shuts a dropped group
  down (blocking on a dead peer): here a dropped group stays live, so a leak shows.

What it does not: carry data. Messages go through the pair's own store (the rendezvous
TCPStore) as (dtype, shape) only, since fake tensors hold no bytes; the receiver checks they
match (NCCL does not: a mismatch is undefined there). Data round trips are the gloo tests'.
A "device" is a number per host thread (`set_device`; CUDA's current device is per thread
too), the host is the machine's name.
"""

from __future__ import annotations

import datetime
import socket
import sys
import threading
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist
from fake_nccl_watchdog import Watchdog
from torch._subclasses.fake_tensor import FakeTensorMode

from tandem.kvtransfer.dist_pairs import PairBackend
from tandem.parallel.world import WorldBackend

NAME = "fake_nccl"
WATCHDOG_EXIT = 134
"""The exit status the watchdog ends a process with (torch's abort: 128 + SIGABRT)."""
POLL_S = 0.001

_lock = threading.Lock()
_live: set[FakeNcclGroup] = set()
_thread_device = threading.local()
_process_device = [0]
_mode: list[FakeTensorMode] = []
_templates: dict[int, torch.Tensor] = {}
_thread_mode = threading.local()


def live_communicators() -> int:
    """Communicators built in this process and not yet aborted or shut down."""
    with _lock:
        return len(_live)


def set_device(index: int, *, process_wide: bool = False) -> None:
    """The calling thread's current device (process_wide: the default of every thread)."""
    if process_wide:
        _process_device[0] = index
    else:
        _thread_device.index = index


def current_device() -> torch.device:
    return torch.device("cuda", getattr(_thread_device, "index", _process_device[0]))


def use_mode(mode: FakeTensorMode) -> None:
    """The FakeTensorMode this backend's tensors are made under (default: one per thread)."""
    with _lock:
        _mode[:] = [mode]
        _templates.clear()


def empty(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.empty on fake CUDA from any thread.
    NOTE: a mode of the thread's own unless a test chose one (use_mode): a FakeTensorMode is
    not thread-safe (while one thread runs an op under it, every fake tensor of the mode
    reports the meta device to the others), and a pair's two sides run on two threads."""
    with _lock:
        if _mode:  # (the test's mode may be entered on another thread: a template's op enters it here)
            if id(_mode[0]) not in _templates:
                with _mode[0]:
                    _templates[id(_mode[0])] = torch.empty(0, device="cuda:0")
            return _templates[id(_mode[0])].new_empty(shape, dtype=dtype, device=device)
    mode = getattr(_thread_mode, "mode", None)
    if mode is None:
        mode = _thread_mode.mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        return torch.empty(shape, dtype=dtype, device=device)


class FakeNcclError(dist.DistBackendError):
    """What torch raises for an NCCL error (a RuntimeError)."""


def _duplicate(rank: int, other: int, device: int) -> FakeNcclError:
    return FakeNcclError(
        "NCCL error in: ProcessGroupNCCL.cpp, invalid usage (run with NCCL_DEBUG=WARN for details), NCCL version "
        "fake\nncclInvalidUsage: This usually reflects invalid usage of NCCL library.\nLast error:\n"
        f"Duplicate GPU detected : rank {rank} and rank {other} both on CUDA device {(device + 1) * 0x1000:x}")


class FakeWork(dist.Work):
    """One send or recv: complete once the peer's matching operation arrived."""

    def __init__(self, op: str, key: str, tensor: torch.Tensor) -> None:
        super().__init__()
        self.op, self.key, self.tensor = op, key, tensor
        self.started = time.monotonic()
        self.done = threading.Event()
        self.mismatch = False
        self.signature = ""
        """A collective's (op, root, dtype, shape), which every rank must post alike."""

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return True  # NOTE: NCCL's: the stream waits, the host does not; nothing raised


class FakeNcclGroup(dist.ProcessGroup):
    """A communicator over `store` (see the module's docstring)."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> None:
        # torch's stubs give only ProcessGroup(store, rank, size, ...); a Python backend's is (rank, size).
        super().__init__(rank, size)  # type: ignore[call-arg]
        self.store, self.timeout = store, timeout
        self.device = current_device()
        host = socket.gethostname()
        store.set(f"{NAME}/rank/{rank}", f"{host}|{self.device.index}")
        keys = [f"{NAME}/rank/{r}" for r in range(size)]
        deadline = time.monotonic() + timeout.total_seconds()
        while not store.check(keys):
            if time.monotonic() > deadline:
                raise FakeNcclError(f"{NAME}: ranks did not all join within {timeout.total_seconds():.1f} s")
            time.sleep(POLL_S)
        for other, key in enumerate(keys):
            other_host, other_device = store.get(key).decode().split("|")
            if other != rank and other_host == host and int(other_device) == self.device.index:
                raise _duplicate(rank, other, self.device.index)
        self._sent, self._received, self._collectives = [0] * size, [0] * size, 0
        self._pending: list[FakeWork] = []
        self.aborted = threading.Event()
        with _lock:
            _live.add(self)
        threading.Thread(target=self._progress, name=f"{NAME}-progress", daemon=True).start()
        _watchdog.ensure()

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return NAME

    def _check(self, tensors: list[torch.Tensor]) -> None:
        if any(t.device.type != "cuda" or t.layout != torch.strided for t in tensors):
            raise ValueError("Tensors must be CUDA and dense")
        if self.aborted.is_set():
            raise FakeNcclError("NCCL communicator was aborted")

    def _collective(self, op: str, tensors: list[torch.Tensor], root: int,
                    outputs: Sequence[torch.Tensor] = ()) -> FakeWork:
        self._check([*tensors, *outputs])
        (t,) = tensors
        work = FakeWork(op, f"{NAME}/coll/{self._collectives}", t)
        self._collectives += 1
        work.signature = f"{op}|{root}|{t.dtype}|{tuple(t.shape)}"
        self.store.set(f"{work.key}/{self.rank()}", work.signature)
        with _lock:
            self._pending.append(work)
        return work

    # The backend API's forms (a list of tensors and options): torch's stubs give the frontend's.
    def allreduce(self, tensors: list[torch.Tensor], opts: object = None) -> FakeWork:  # type: ignore[override]
        return self._collective("allreduce", tensors, -1)

    def broadcast(self, tensors: list[torch.Tensor],  # type: ignore[override]
                  opts: dist.BroadcastOptions | None = None) -> FakeWork:
        return self._collective("broadcast", tensors, 0 if opts is None else opts.rootRank)

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],  # type: ignore[override]
               opts: dist.GatherOptions | None = None) -> FakeWork:
        outputs = output_tensors[0] if output_tensors else []
        return self._collective("gather", input_tensors, 0 if opts is None else opts.rootRank, outputs)

    def barrier(self, opts: object = None) -> FakeWork:  # NCCL's: an allreduce of one element
        return self._collective("barrier", [empty(1, dtype=torch.float32, device=self.device)], -1)

    def _post(self, op: str, tensors: list[torch.Tensor], peer: int) -> FakeWork:
        self._check(tensors)
        (t,) = tensors
        counts = self._sent if op == "send" else self._received
        src, dst = (self.rank(), peer) if op == "send" else (peer, self.rank())
        work = FakeWork(op, f"{NAME}/p2p/{src}-{dst}/{counts[peer]}", t)
        counts[peer] += 1
        if op == "send":
            self.store.set(work.key, f"{t.dtype}|{tuple(t.shape)}")
        with _lock:
            self._pending.append(work)
        return work

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> FakeWork:
        return self._post("send", tensors, dst)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> FakeWork:
        return self._post("recv", tensors, src)

    def _progress(self) -> None:
        """The "device" side: completes works as their peer's operations arrive."""
        while not self.aborted.is_set():
            with _lock:
                pending = list(self._pending)
            for work in pending:
                try:
                    self._advance(work)
                except Exception:  # NOTE: a dead peer's store: the work just never completes
                    pass
            time.sleep(POLL_S)

    def _advance(self, work: FakeWork) -> None:
        ack = work.key + "/ack"
        if work.signature:
            keys = [f"{work.key}/{r}" for r in range(self.size())]
            if not self.store.check(keys):
                return
            signatures = {self.store.get(k).decode() for k in keys}
            if signatures != {work.signature}:  # (a desync: NCCL hangs; the fake says why, then hangs too)
                if not work.mismatch:
                    print(f"[{NAME}] {work.key}: ranks posted {sorted(signatures)}", file=sys.stderr)
                work.mismatch = True
                return
        elif work.op == "recv" and self.store.check([work.key]):
            sent = self.store.get(work.key).decode()
            mine = f"{work.tensor.dtype}|{tuple(work.tensor.shape)}"
            if sent != mine:  # (NCCL would not notice: the fake does, to catch protocol slips; never completes)
                if not work.mismatch:
                    print(f"[{NAME}] recv {work.key}: sent {sent}, received into {mine}", file=sys.stderr)
                work.mismatch = True
                return
            self.store.set(ack, "1")
        elif not (work.op == "send" and self.store.check([ack])):
            return
        with _lock:
            self._pending.remove(work)
        work.done.set()

    def overdue(self, now: float) -> FakeWork | None:
        """A work incomplete past the group's timeout (None when aborted: nothing is watched)."""
        if self.aborted.is_set():
            return None
        with _lock:
            return next((w for w in self._pending if now - w.started > self.timeout.total_seconds()), None)

    def abort(self) -> None:
        self.aborted.set()
        with _lock:
            _live.discard(self)
            self._pending = []

    def shutdown(self) -> None:
        self.abort()


def _live_groups() -> list[FakeNcclGroup]:
    with _lock:
        return list(_live)


_watchdog = Watchdog(_live_groups, NAME, WATCHDOG_EXIT)


def create(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> FakeNcclGroup:
    """torch's creator signature (Backend.register_backend)."""
    return FakeNcclGroup(store, rank, size, timeout)


def _pair(store: dist.Store, rank: int, timeout: datetime.timedelta, host: str) -> FakeNcclGroup:
    return FakeNcclGroup(store, rank, 2, timeout)


def _bind(device: torch.device) -> None:
    set_device(0 if device.index is None else device.index, process_wide=True)


def _refuses(device: torch.device) -> str | None:
    return None if device.type == "cuda" else "NCCL needs the pool on a CUDA device"


PAIR = PairBackend(_pair, current_device, _refuses, empty)
"""What dist_pairs makes pairs with when a test puts the fake in NCCL's place."""
WORLD = WorldBackend(NAME, _bind)
"""What ranks.join_groups makes the device group with when a test puts the fake in NCCL's place."""

if NAME.upper() not in dist.Backend._plugins:  # (imported once per process, but be safe)
    dist.Backend.register_backend(NAME, create, devices=["cuda"])
