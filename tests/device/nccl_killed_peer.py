"""Two workers' sides of KV pairs over the fake NCCL backend, each in a process of its own (run
by test_nccl_killed_peer.py, which SIGKILLs the victim mid-transfer). Lines of JSON go
between them through the test: offers one way, "ready"/"killed" marks, then the survivor's
report.

- pair "to_victim": the survivor sends (a prefill worker), the victim receives; the victim
  hosts its rendezvous.
- pair "from_victim": the victim sends, the survivor receives (a decode worker); the
  survivor hosts its rendezvous. The victim is killed after sending layer 1's K but not its V.
- pair "live": both sides in the survivor, which must keep working after the kill.

NOTE: processes of their own, since the fake watchdog ends the process it runs in.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

import fake_nccl
import torch

from tandem.kvtransfer import dist_pairs

TIMEOUT_S = 2.0
ROWS = (3, 64)  # the default model's KV heads and head_dim
N = 4
ADDRESS = "tcp://127.0.0.1:5555"


def say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def hear() -> dict[str, Any]:
    return json.loads(sys.stdin.readline())


def rows() -> torch.Tensor:
    return fake_nccl.empty(N, *ROWS, dtype=torch.bfloat16, device=fake_nccl.current_device())


def recv_one(payload: Any) -> torch.Tensor:
    """One tensor of N rows (half a layer): a layer's K, or its V."""
    t = fake_nccl.empty(N, *ROWS, dtype=torch.bfloat16, device=payload.device)
    work = payload._own.recv([t], dist_pairs.SENDER_RANK, 0)
    payload._finish(work, f"recv from rank {dist_pairs.SENDER_RANK}")
    return t


def victim() -> None:
    fake_nccl.set_device(1, process_wide=True)
    receivers = dist_pairs.ReceiverPairs(ADDRESS, TIMEOUT_S)
    say(offer=receivers.offer(b"survivor", "nccl"))
    to_me = receivers.payload(b"survivor")
    mine = dist_pairs.join_pair(ADDRESS, hear()["offer"], TIMEOUT_S)
    k = rows()
    mine.send(dist_pairs.RECEIVER_RANK, k, k)  # layer 0
    work = mine._own.send([k], dist_pairs.RECEIVER_RANK, 0)  # layer 1's K, then killed before its V
    mine._finish(work, "send")
    to_me.recv(dist_pairs.SENDER_RANK, N, ROWS, "bfloat16")  # layer 0 from the survivor
    say(ready=True)
    time.sleep(60)  # (killed here)


def survivor() -> None:
    fake_nccl.set_device(0, process_wide=True)
    receivers = dist_pairs.ReceiverPairs(ADDRESS, TIMEOUT_S)
    offer_to_victim = hear()["offer"]
    say(offer=receivers.offer(b"victim", "nccl"))
    to_victim = dist_pairs.join_pair(ADDRESS, offer_to_victim, TIMEOUT_S)
    from_victim = receivers.payload(b"victim")
    k = rows()
    live_receiver = dist_pairs.ReceiverPairs(ADDRESS, TIMEOUT_S)
    live_offer = live_receiver.offer(b"live", "nccl")
    fake_nccl.set_device(2)  # (this thread: the live pair's sender, on a device of its own)
    live = dist_pairs.join_pair(ADDRESS, live_offer, TIMEOUT_S), live_receiver.payload(b"live")
    k_live = rows()
    from_victim.recv(dist_pairs.SENDER_RANK, N, ROWS, "bfloat16")  # layer 0
    recv_one(from_victim)  # layer 1's K
    to_victim.send(dist_pairs.RECEIVER_RANK, k, k)  # layer 0
    say(sent=True)  # (the victim is killed only once this send completed here too)
    hear()  # {"killed": true}
    out: dict[str, Any] = {}
    for name, step in (("send", lambda: to_victim.send(dist_pairs.RECEIVER_RANK, k, k)),
                       ("recv", lambda: recv_one(from_victim))):  # layer 1 (its V, on the receiving side)
        start = time.monotonic()
        try:
            step()
            out[name] = "completed"
        except RuntimeError as e:
            out[name] = f"{type(e).__name__}: {e}"
        out[f"{name}_s"] = time.monotonic() - start
    got: list[torch.Tensor] = []
    t = threading.Thread(target=lambda: got.extend(live[1].recv(dist_pairs.SENDER_RANK, N, ROWS, "bfloat16")))
    t.start()
    live[0].send(dist_pairs.RECEIVER_RANK, k_live, k_live)
    t.join(TIMEOUT_S)
    out["live"] = len(got)
    time.sleep(1.5 * TIMEOUT_S)  # past every group's watchdog timeout
    say(**out, alive=True, live_communicators=fake_nccl.live_communicators())


if __name__ == "__main__":
    dist_pairs.PAIR_BACKENDS["nccl"] = fake_nccl.PAIR  # (a process of its own: nothing to restore)
    {"victim": victim, "survivor": survivor}[sys.argv[1]]()
    # NOTE: no interpreter finalization: the fake's daemon threads may be inside a torch store
    # call against the dead peer's store, which aborts it ("terminate called ..."); what is
    # under test ended with the report above.
    os._exit(0)
