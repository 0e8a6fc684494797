"""A tensor-parallel decode worker's two ranks on the fake NCCL backend (fake_nccl.py), each
in a process of its own (run by test_tp_kv_over_fake_nccl.py), at the default model's shapes
on fake CUDA: the device group is the fake (ranks.join_groups, the fake in NCCL's place),
the step group real gloo over real host messages. Rank 0 also receives one layer's KV from a
prefill sender (a thread on another device) over a fake NCCL pair: DistPayload.recv gives
device rows, which go through PendingKVWrites into a FORWARD step message.

Each rank reports, as plain values: how many times a CUDA tensor was pinned, the ops that
copied a device tensor to the host, the KV writes into its cache (the source's device and
shape), and the collectives it posted on the device group."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import threading
import traceback
from collections import Counter
from collections.abc import Iterator, MutableMapping
from typing import Any

import fake_nccl
import numpy as np
import torch
import torch.distributed as dist
from fake_cuda import BATCHES, CUDA, SMOLLM2, fake_cuda_bindings, fake_to_device, random_weights
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tandem.engine import step_inputs
from tandem.engine.model_runner import ModelRunner
from tandem.kernels import ops
from tandem.kvtransfer import dist_pairs
from tandem.model.loader import LoadedModel
from tandem.parallel import executor as executor_module
from tandem.parallel import world
from tandem.parallel.ranks import join_groups
from tandem.parallel.runner import TensorParallelRunner
from tandem.parallel.step_message import StepOp, receive_step

TP = 2
LAYER = 7
SLOTS = np.array([80, 81, 82, 83, 84], dtype=np.int64)  # block 5 of the decode worker
SENDER_DEVICE = 7  # the prefill worker's GPU
ADDRESS = "tcp://127.0.0.1:5555"
HANG_DUMP_S = 240.0
"""How long rank 1 may run before it dumps its threads' stacks and ends."""


class DeviceTraffic(TorchDispatchMode):
    """The ops that bring a device tensor to the host, and every write into a KV cache."""

    def __init__(self) -> None:
        super().__init__()
        self.to_host: list[str] = []
        self.kv_writes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if any(t.device.type == "cuda" for t in ins) and any(t.device.type == "cpu" for t in outs):
            self.to_host.append(str(func))
        if func in (torch.ops.aten.index_copy_.default, torch.ops.aten.index_copy.default):
            source = args[3]
            self.kv_writes.append((str(source.device), tuple(source.shape)))
        return out


def cuda_pin_memory(t: torch.Tensor, device: Any = None) -> torch.Tensor:
    """Tensor.pin_memory as torch with CUDA behaves: a device tensor is refused."""
    PINS.append(str(t.device))
    if t.device.type != "cpu":
        raise RuntimeError(f"cannot pin '{t.type()}' only dense CPU tensors can be pinned")
    return t


PINS: list[str] = []
REAL_TO_DEVICE = step_inputs.to_device


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The real step_inputs.to_device for tensors already on the device (what it must do with
    them is the point); host tensors cross as fake_to_device makes them (no CUDA here)."""
    return REAL_TO_DEVICE(t, device) if t.device.type == "cuda" else fake_to_device(t, device)


def receive_layer(runner: TensorParallelRunner) -> str:
    """One layer's K and V for SLOTS, from a sender on another device over a fake NCCL pair,
    into rank 0's pending KV writes. -> the device the rows arrived on."""
    receiver = dist_pairs.ReceiverPairs(ADDRESS, 2.0)
    offer = receiver.offer(b"prefill", "nccl")
    sent: list[BaseException] = []
    # (made here: a FakeTensorMode is not thread-safe, and this thread allocates the recv's)
    rows = fake_nccl.empty(len(SLOTS), SMOLLM2.num_kv_heads, SMOLLM2.head_dim, dtype=torch.bfloat16,
                           device=torch.device("cuda", SENDER_DEVICE))

    def send() -> None:
        fake_nccl.set_device(SENDER_DEVICE)
        try:
            mine = dist_pairs.join_pair(ADDRESS, offer, 2.0)
            mine.send(dist_pairs.RECEIVER_RANK, rows, rows)
            mine.close()
        except BaseException as e:  # (reported by the receiving side)
            sent.append(e)

    sender = threading.Thread(target=send)
    sender.start()
    try:
        k, v = receiver.payload(b"prefill").recv(dist_pairs.SENDER_RANK, len(SLOTS),
                                                 (SMOLLM2.num_kv_heads, SMOLLM2.head_dim), "bfloat16")
    finally:
        sender.join(5)
        receiver.close()
        if sent:
            raise sent[0]
    runner.kv_writes.write(LAYER, 0, SLOTS, [k])
    runner.kv_writes.write(LAYER, 1, SLOTS, [v])
    return str(k.device)


@contextlib.contextmanager
def fake_nccl_world() -> Iterator[Counter[str]]:
    """The fake in NCCL's place for the device group and pairs, with this module's shims
    (restored after: rank 0 runs in the test's own process). -> the collectives posted."""
    posted: Counter[str] = Counter()
    collective = fake_nccl.FakeNcclGroup._collective

    def counting(self, op, *args, **kwargs):  # noqa: ANN001
        posted[op] += 1
        return collective(self, op, *args, **kwargs)

    patches = [
        (world.WORLD_BACKENDS, "nccl", fake_nccl.WORLD), (dist_pairs.PAIR_BACKENDS, "nccl", fake_nccl.PAIR),
        (step_inputs, "to_device", to_device), (torch.Tensor, "pin_memory", cuda_pin_memory),
        # dist.broadcast asks a CUDA tensor's device for its capability, which a torch built
        # without CUDA refuses: the H200's (sm90).
        (torch.cuda, "get_device_capability", lambda device=None: (9, 0)),
        (fake_nccl.FakeNcclGroup, "_collective", counting), (os.environ, ops.BACKEND_ENV, "torch"),
        (executor_module.RankExecutor, "execute", executor_module.RankExecutor.execute),  # (set in run_step)
    ]
    saved = [(where, name, where.get(name) if isinstance(where, MutableMapping) else getattr(where, name, None))
             for where, name, _ in patches]
    for where, name, value in patches:
        where.__setitem__(name, value) if isinstance(where, MutableMapping) else setattr(where, name, value)
    PINS.clear()
    try:
        yield posted
    finally:
        for where, name, value in saved:
            if isinstance(where, MutableMapping):
                where.pop(name, None) if value is None else where.__setitem__(name, value)
            else:
                setattr(where, name, value)


def run_rank(rank: int, init_method: str, results: Any) -> None:
    """Rank `rank` of TP: join, run one FORWARD step (rank 0 builds and broadcasts it), report."""
    report: dict[str, Any] = {"rank": rank}
    if rank != 0:  # (a process of its own: a hang shows where, in the test's captured stderr)
        faulthandler.dump_traceback_later(HANG_DUMP_S, exit=True)
    try:
        with fake_nccl_world() as posted:
            groups = join_groups(init_method, rank, TP, torch.device("cuda", rank))
            report["device_backend"] = dist.get_backend()
            mode = FakeTensorMode(allow_non_fake_inputs=True)  # (the host message's tensors are real)
            fake_nccl.use_mode(mode)
            traffic = DeviceTraffic()
            with fake_cuda_bindings():
                report.update(run_step(rank, groups, mode, traffic))
            report.update(pins=list(PINS), to_host=traffic.to_host, kv_writes=traffic.kv_writes, posted=dict(posted))
    except BaseException as e:
        report["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        results.put(report)
        faulthandler.cancel_dump_traceback_later()


def run_step(rank: int, groups: Any, mode: FakeTensorMode, traffic: DeviceTraffic) -> dict[str, Any]:
    from test_tp_step_message import engine_config  # (a tp=2 engine on cuda:0, as that test builds it)

    config = engine_config()
    with mode:
        loaded = LoadedModel(SMOLLM2, random_weights(SMOLLM2, config.dtype), None)
        part = executor_module.rank_model(loaded, TP, rank, config.max_model_len, groups.collectives, CUDA)
    execute = executor_module.RankExecutor.execute

    def on_the_device(self, msg, hook=None):  # noqa: ANN001
        with mode, traffic:  # the step's device side; the message stays real host tensors
            return execute(self, msg, hook)

    setattr(executor_module.RankExecutor, "execute", on_the_device)
    if rank == 0:
        with mode:
            runner = TensorParallelRunner(config, part, groups.collectives, groups.step_group)
        arrived_on = receive_layer(runner)
        logits = runner.forward(BATCHES["decodes"][0](), None, None)
        return {"rows_arrived_on": arrived_on, "logits_on": str(logits.device)}
    with mode:  # as ranks.RankProcess builds its rank
        pool = ModelRunner(config, part)
        other = executor_module.RankExecutor(part, pool.kv_cache, pool.swapper, TP, rank, groups.collectives)
    msg = receive_step(groups.step_group)
    assert msg.op is StepOp.FORWARD and msg.writes is not None and msg.writes.rows is None
    assert other.execute(msg) is None
    return {"rows_in_message": len(msg.writes.index)}
