"""A prefill worker's side of two KV pairs over the fake NCCL backend, in a process of its
own (run by test_nccl_dead_peer.py): one peer hangs (its recv is never posted), the other
lives. Prints one JSON line: what the send to the hung peer raised and how soon, whether the
live pair still works, and (once past the groups' watchdog timeout) that it is still alive.
NOTE: a process of its own, since the fake watchdog ends the process it runs in."""

from __future__ import annotations

import json
import sys
import threading
import time

import fake_nccl
import torch

from tandem.kvtransfer import dist_pairs

TIMEOUT_S = 2.0
ROWS = (3, 64)


def main() -> None:
    dist_pairs.PAIR_BACKENDS["nccl"] = fake_nccl.PAIR
    fake_nccl.set_device(1)  # the sender's thread; the receivers' pair threads are on device 0
    receivers = dist_pairs.ReceiverPairs("tcp://127.0.0.1:5555", TIMEOUT_S)
    pairs = {}
    for name in ("hung", "live"):
        mine = dist_pairs.join_pair("tcp://127.0.0.1:5555", receivers.offer(name.encode(), "nccl"), TIMEOUT_S)
        pairs[name] = (mine, receivers.payload(name.encode()))
    k = fake_nccl.empty(4, *ROWS, dtype=torch.bfloat16, device=fake_nccl.current_device())
    out: dict[str, object] = {}
    start = time.monotonic()
    try:
        pairs["hung"][0].send(dist_pairs.RECEIVER_RANK, k, k)
        out["hung"] = "sent"
    except RuntimeError as e:
        out["hung"] = f"{type(e).__name__}: {e}"
    out["hung_s"] = time.monotonic() - start
    mine, theirs = pairs["live"]
    got: list[torch.Tensor] = []
    t = threading.Thread(target=lambda: got.extend(theirs.recv(0, 4, ROWS, "bfloat16")))
    t.start()
    mine.send(dist_pairs.RECEIVER_RANK, k, k)
    t.join(TIMEOUT_S)
    out["live"] = len(got)
    print(json.dumps(out), flush=True)
    time.sleep(1.5 * TIMEOUT_S)  # past every group's watchdog timeout
    print(json.dumps({"alive": True, "live_communicators": fake_nccl.live_communicators()}), flush=True)


if __name__ == "__main__":
    main()
    sys.exit(0)
