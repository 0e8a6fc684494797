"""Transfers between real processes: a sender and a receiver spawned apart, as a prefill and a
decode worker would be, over ZMQ IPC, TCP loopback and torch.distributed (gloo). The receiver
process checks the bytes in its own pool; the test only steers both sides and reads results.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Callable, Iterator

import pytest
from process_worker import Plan, PoolSpec, WorkerError, WorkerProcess

from tandem.kvtransfer.protocol import Destination, TransferStatus

Spawn = Callable[..., WorkerProcess]

TOKEN_COUNTS = (1, 15, 16, 17, 100)  # inside one block, at and across block edges, many blocks
# lane -> (sender's pool, receiver's pool): block sizes differ between the sides, as may dtypes per lane.
LANES = {
    "f32": (PoolSpec(3, 16, 16, 2, 8, "float32", seed=1), PoolSpec(3, 48, 4, 2, 8, "float32", seed=2)),
    "bf16": (PoolSpec(3, 16, 16, 2, 8, "bfloat16", seed=3), PoolSpec(3, 40, 5, 2, 8, "bfloat16", seed=4)),
}


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """Start worker processes; every one is stopped (or killed) at teardown, whatever happened."""
    started: list[WorkerProcess] = []

    def start(role: str, **setup: object) -> WorkerProcess:
        worker = WorkerProcess(role, **setup)
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.request_stop()
    for worker in started:
        worker.stop()


def _blocks(rng: random.Random, free: list[int], num_tokens: int, block_size: int) -> tuple[int, ...]:
    """Take a request's blocks from a shuffled free list, so block ids are in no particular order."""
    n = -(-num_tokens // block_size)
    taken, free[:] = free[:n], free[n:]
    return tuple(taken)


def make_plans(lane: str, seed: int, token_counts: tuple[int, ...] = TOKEN_COUNTS) -> list[Plan]:
    """Requests of `token_counts` tokens on `lane`; all but 1-token ones go in two chunks per layer."""
    rng = random.Random(seed)
    src, dst = LANES[lane]
    src_free, dst_free = list(range(src.num_blocks)), list(range(dst.num_blocks))
    rng.shuffle(src_free)
    rng.shuffle(dst_free)
    plans = []
    for i, n in enumerate(token_counts):
        split = rng.randint(1, n - 1) if n > 1 else n
        chunks = ((0, split), (split, n)) if split < n else ((0, n),)
        plans.append(Plan(f"{lane}-{i}", n, _blocks(rng, src_free, n, src.block_size),
                          _blocks(rng, dst_free, n, dst.block_size), chunks))
    return plans


def addresses(transport: str, tmp_path: Path) -> dict[str, str]:
    # Short socket names: an ipc path must fit in sun_path (about 107 bytes).
    return {lane: f"ipc://{tmp_path}/{lane}.sock" if transport == "ipc" else "tcp://127.0.0.1:0" for lane in LANES}


def start_pair(spawn: Spawn, addrs: dict[str, str], receiver_timeout_s: float = 10.0,
               sender_timeout_s: float = 10.0, pairs: bool = False) -> tuple[WorkerProcess, WorkerProcess]:
    """Both sides of every lane, spawned at once (each takes seconds to import torch).
    pairs: a gloo group of two per connection, made in the handshake (what
    `tandem serve --kv-transport gloo` does)."""
    receiver = spawn("receiver", pools={lane: dst for lane, (_, dst) in LANES.items()}, addresses=addrs,
                     timeout_s=receiver_timeout_s)
    sender = spawn("sender", pools={lane: src for lane, (src, _) in LANES.items()}, timeout_s=sender_timeout_s,
                   transport="gloo" if pairs else "auto")
    receiver.ready()
    sender.ready()
    return receiver, sender


def round_trip(receiver: WorkerProcess, sender: WorkerProcess, lane: str, plans: list[Plan]) -> None:
    """All of `plans` in flight at once on one lane; both sides see DONE for each, and the
    receiver's pool holds exactly the sender's bytes in the reserved slots and nothing else changed."""
    for plan in plans:
        sender.call("begin", lane, receiver.call("expect", lane, plan), plan)
    assert all(sender.call("send", lane, plans))
    for plan in plans:
        event, _ = sender.call("wait", lane, plan.request_id, 10.0)
        assert event.status is TransferStatus.DONE, event
    events = receiver.call("wait_events", lane, len(plans), 10.0)
    assert sorted((e.request_id, e.status) for e, _ in events) == \
        sorted((p.request_id, TransferStatus.DONE) for p in plans)
    assert receiver.call("check", lane, LANES[lane][0], plans) == []
    assert receiver.call("state", lane) == {"num_pending": 0, "dropped": {}}
    assert sender.call("state", lane) == {"num_pending": 0}


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_round_trip_between_processes(spawn: Spawn, tmp_path: Path, transport: str) -> None:
    """Every byte of several requests (1 to 100 tokens, chunked layers, shuffled blocks, block
    sizes 16 -> 4 and 16 -> 5, float32 and bfloat16) lands in the other process's reserved slots."""
    receiver, sender = start_pair(spawn, addresses(transport, tmp_path))
    for lane in LANES:
        round_trip(receiver, sender, lane, make_plans(lane, seed=len(lane)))


def test_round_trip_on_gloo_pairs(spawn: Spawn, tmp_path: Path) -> None:
    """The same round trip with a gloo group of two per lane, made in each lane's handshake
    (no world set up beforehand), over TCP: both lanes at once, each on its own pair."""
    receiver, sender = start_pair(spawn, addresses("tcp", tmp_path), pairs=True)
    for lane in LANES:
        round_trip(receiver, sender, lane, make_plans(lane, seed=11))


def test_handshake_refused_across_processes(spawn: Spawn, tmp_path: Path) -> None:
    """A sender whose pool cannot be written into the receiver's (head_dim, then dtype differ)
    gets TransferRefused from `begin`, naming the field, and is left with nothing pending."""
    src = PoolSpec(3, 8, 16, 2, 8, "float32", seed=0)
    # One receiver per mismatched field, all in one process: spawning is what costs time here.
    mismatched = {"head_dim": PoolSpec(3, 8, 4, 2, 16, "float32", seed=0),
                  "dtype": PoolSpec(3, 8, 4, 2, 8, "bfloat16", seed=0)}
    receiver = spawn("receiver", pools=mismatched, addresses={f: f"ipc://{tmp_path}/{f}.sock" for f in mismatched},
                     timeout_s=10.0)
    sender = spawn("sender", pools={f: src for f in mismatched}, timeout_s=10.0)
    receiver.ready()
    sender.ready()
    for field in mismatched:
        dest = Destination("r0", receiver.call("address", field), (0,), 4)
        with pytest.raises(WorkerError) as refused:
            sender.call("begin", field, dest, Plan("r0", 4, (0,), (0,), ((0, 4),)))
        assert refused.value.type_name == "TransferRefused"
        assert f"{field} differs" in refused.value.message
        assert sender.call("state", field) == {"num_pending": 0}


def test_sender_killed_mid_transfer(spawn: Spawn, tmp_path: Path) -> None:
    """A sender SIGKILLed after some layers: the receiver fails the request at its deadline, holds
    nothing pending, and a new sender process then completes a fresh request."""
    timeout_s = 1.0
    lane = "f32"
    src, dst = LANES[lane]
    victim, fresh = make_plans(lane, seed=11, token_counts=(40, 17))
    receiver = spawn("receiver", pools={lane: dst}, addresses={lane: "tcp://127.0.0.1:0"}, timeout_s=timeout_s)
    doomed = spawn("sender", pools={lane: src}, timeout_s=10.0)
    successor = spawn("sender", pools={lane: src}, timeout_s=10.0)  # started now: it takes seconds to come up
    for worker in (receiver, doomed, successor):
        worker.ready()

    doomed.call("begin", lane, receiver.call("expect", lane, victim), victim)
    assert all(doomed.call("send", lane, [victim], [0, 1]))  # two of three layers
    assert receiver.call("wait_landed", lane, src, victim, [0, 1], 5.0), "the first layers never arrived"
    doomed.kill()

    [(event, elapsed)] = receiver.call("wait_events", lane, 1, timeout_s + 5.0)
    assert (event.request_id, event.status) == (victim.request_id, TransferStatus.FAILED)
    assert event.reason.startswith("timed out")
    assert timeout_s <= elapsed < timeout_s + 1.0  # the deadline sweep runs on a timer, not on traffic
    assert receiver.call("state", lane) == {"num_pending": 0, "dropped": {"timeout": 1}}

    # The long expect timeout keeps a slow machine from failing the fresh request.
    successor.call("begin", lane, receiver.call("expect", lane, fresh, 10.0), fresh)
    assert all(successor.call("send", lane, [fresh]))
    assert successor.call("wait", lane, fresh.request_id, 10.0)[0].status is TransferStatus.DONE
    [(event, _)] = receiver.call("wait_events", lane, 1, 10.0)
    assert (event.request_id, event.status) == (fresh.request_id, TransferStatus.DONE)
    assert receiver.call("check", lane, src, [fresh], victim.dst_block_ids) == []
    assert receiver.call("state", lane)["num_pending"] == 0


def test_receiver_killed_mid_transfer(spawn: Spawn, tmp_path: Path) -> None:
    """A receiver SIGKILLed after some layers arrived: the sender's remaining sends still return at
    once, and its `wait` reports FAILED at the sender's timeout with nothing left pending."""
    timeout_s = 1.0
    lane = "bf16"
    src, dst = LANES[lane]
    [plan] = make_plans(lane, seed=5, token_counts=(33,))
    receiver = spawn("receiver", pools={lane: dst}, addresses={lane: f"ipc://{tmp_path}/r.sock"}, timeout_s=30.0)
    sender = spawn("sender", pools={lane: src}, timeout_s=timeout_s)
    receiver.ready()
    sender.ready()

    sender.call("begin", lane, receiver.call("expect", lane, plan), plan)
    assert all(sender.call("send", lane, [plan], [0]))
    assert receiver.call("wait_landed", lane, src, plan, [0], 5.0), "the first layer never arrived"
    receiver.kill()

    # ZMQ queues for a peer that is gone: the step loop must not block on it.
    sender.call("send", lane, [plan], [1, 2], timeout_s=5.0)  # returns (False once the loss is seen)
    event, elapsed = sender.call("wait", lane, plan.request_id, timeout_s + 5.0)
    # Either the send finds the connection gone at once, or the ack never comes.
    assert event.status is TransferStatus.FAILED, event
    assert event.reason in ("receiver not accepting messages", "timed out waiting for the receiver"), event
    assert elapsed < timeout_s + 1.0
    assert sender.call("state", lane) == {"num_pending": 0}


def test_sends_to_a_dead_receiver_never_block(spawn: Spawn, tmp_path: Path) -> None:
    """However many layers a sender sends after its receiver died (more than ZMQ's queue of 1000
    messages), its step loop goes on, and the request fails at the sender's timeout."""
    timeout_s = 1.0
    lane = "f32"
    src, dst = LANES[lane]
    [plan] = make_plans(lane, seed=5, token_counts=(33,))
    receiver = spawn("receiver", pools={lane: dst}, addresses={lane: "tcp://127.0.0.1:0"}, timeout_s=30.0)
    sender = spawn("sender", pools={lane: src}, timeout_s=timeout_s)
    receiver.ready()
    sender.ready()

    sender.call("begin", lane, receiver.call("expect", lane, plan), plan)
    receiver.kill()
    try:
        # 400 x 3 layers x 2 chunks = 2400 LAYER messages; ZMQ counts messages, so one request's
        # layers over and over stand in for the layers of many requests in flight.
        sender.call("send", lane, [plan] * 400, timeout_s=3.0)  # takes a tenth of that when it works
    except TimeoutError:
        sender.kill()  # blocked inside ZMQ: asking it to stop would wait in vain
        raise
    event, _ = sender.call("wait", lane, plan.request_id, timeout_s + 5.0)
    assert event.status is TransferStatus.FAILED, event
    assert sender.call("state", lane) == {"num_pending": 0}


def test_gloo_sender_killed_between_header_and_tensors(spawn: Spawn, tmp_path: Path) -> None:
    """A torch.distributed sender killed after a LAYER header went out but before its tensors:
    the receiver still fails the request (at the latest at its deadline) and holds nothing pending."""
    # Long enough that the header surely comes while the request is pending (else the sweep
    # fails the request first and the test proves nothing), short enough to keep the test quick.
    timeout_s = 3.0
    lane = "f32"
    [plan] = make_plans(lane, seed=5, token_counts=(33,))
    receiver, sender = start_pair(spawn, addresses("ipc", tmp_path), receiver_timeout_s=timeout_s, pairs=True)

    sender.call("begin", lane, receiver.call("expect", lane, plan), plan)
    assert all(sender.call("send", lane, [plan], [0]))
    assert receiver.call("wait_landed", lane, LANES[lane][0], plan, [0], 5.0), "the first layer never arrived"
    assert sender.call("send_header_only", lane, plan, 1)
    time.sleep(0.5)  # ZMQ's I/O thread has sent the header: the receiver waits in recv now
    sender.kill()

    events = receiver.call("wait_events", lane, 1, timeout_s + 1.5)
    assert [(e.request_id, e.status) for e, _ in events] == [(plan.request_id, TransferStatus.FAILED)]
    # The pair's socket closed with the process: failed at once, not at the deadline.
    assert "peer lost" in events[0][0].reason and events[0][1] < timeout_s, events
    assert receiver.call("state", lane)["num_pending"] == 0
