"""The CUDA IPC path on a GPU: a decode-side process exports its pool (the default model's
layout) at the handshake, this process writes a prompt's KV into it through the real
KVSender/KVReceiver code (path_choice -> cuda_ipc), the receiver checks every byte, and the
write is timed against a plain device copy of the same bytes in one process.

Importable without CUDA; `run_ipc_check` says FAIL (with why) where there is none."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import torch

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, DTYPE = 30, 3, 64, torch.bfloat16
"""The default model's KV layout (SmolLM2-135M)."""
NUM_BLOCKS, BLOCK_SIZE = 512, 16
PROMPT_TOKENS = 2048
REPEATS = 5
TIMEOUT_S = 60.0


def _pattern(num_tokens: int, salt: int, device: torch.device) -> torch.Tensor:
    """[layers, 2, tokens, heads, dim] rows both processes can make: no two alike."""
    n = NUM_LAYERS * 2 * num_tokens * NUM_KV_HEADS * HEAD_DIM
    values = (torch.arange(n, device=device, dtype=torch.int64) * 7919 + salt) % 65521
    return (values.to(torch.float32) / 64).to(DTYPE).view(NUM_LAYERS, 2, num_tokens, NUM_KV_HEADS, HEAD_DIM)


def _receiver_main(requests: Any, replies: Any) -> None:
    """The decode side, in a child: a pool exported by CUDA IPC, one reservation per request."""
    from tandem.kvtransfer.cuda_ipc import DevicePoolExport
    from tandem.kvtransfer.payload import layout_for
    from tandem.kvtransfer.placement import host_identity
    from tandem.kvtransfer.receiver import KVReceiver

    device = torch.device("cuda", 0)
    shape = (NUM_LAYERS, 2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    pool = torch.zeros(shape, dtype=DTYPE, device=device)
    export = DevicePoolExport.create(pool, layout_for(shape, DTYPE), host_identity())
    if export is None:
        replies.put(("error", "the pool could not be exported (see the log)"))
        return
    receiver = KVReceiver(pool, timeout_s=TIMEOUT_S, shared_pool=export)
    try:
        while True:
            request = requests.get()
            if request is None:
                return
            request_id, block_ids, salt = request
            replies.put(("dest", receiver.expect(request_id, block_ids, PROMPT_TOKENS)))
            event = receiver.get_event(TIMEOUT_S)
            torch.cuda.synchronize(device)
            slots = torch.tensor(block_ids, device=device).repeat_interleave(BLOCK_SIZE) * BLOCK_SIZE \
                + torch.arange(BLOCK_SIZE, device=device).repeat(len(block_ids))
            got = pool.flatten(2, 3).index_select(2, slots[:PROMPT_TOKENS])
            exact = bool(torch.equal(got, _pattern(PROMPT_TOKENS, salt, device)))
            replies.put(("event", None if event is None else event.status.name, exact))
    finally:
        receiver.close()
        export.close()


def _device_copy_gbs(num_bytes: int) -> float:
    """A plain device-to-device copy of `num_bytes` in this process, in GB/s (bytes copied)."""
    src = torch.empty(num_bytes // 2, dtype=DTYPE, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(REPEATS):
        dst.copy_(src)
    torch.cuda.synchronize()
    return num_bytes * REPEATS / (time.perf_counter() - started) / 1e9


def run_ipc_check() -> list[str]:
    """-> printable PASS/FAIL lines: the path taken, bytes exact, IPC write GB/s vs a device copy."""
    if not torch.cuda.is_available():
        return ["FAIL cuda_ipc: no CUDA device in this process"]
    from tandem.bench.transfers.sender_events import SenderEvents
    from tandem.kvtransfer.protocol import TransferStatus
    from tandem.kvtransfer.sender import KVSender

    ctx = mp.get_context("spawn")
    requests, replies = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_receiver_main, args=(requests, replies), name="ipc-receiver", daemon=True)
    child.start()
    lines: list[str] = []
    sender = None
    try:
        src_blocks = -(-PROMPT_TOKENS // BLOCK_SIZE)
        src_pool = torch.zeros(NUM_LAYERS, 2, src_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE,
                               device="cuda")
        sender = KVSender(src_pool, timeout_s=TIMEOUT_S)
        num_bytes = NUM_LAYERS * 2 * PROMPT_TOKENS * NUM_KV_HEADS * HEAD_DIM * 2
        seconds: list[float] = []
        for round_ in range(REPEATS + 1):  # the first round shakes hands and opens the pool: not timed
            salt = 1000 + round_
            src_pool.flatten(2, 3)[:, :, :PROMPT_TOKENS] = _pattern(PROMPT_TOKENS, salt, src_pool.device)
            # Scattered destination blocks, as a busy decode pool gives.
            block_ids = [(i * 37 + round_) % NUM_BLOCKS for i in range(src_blocks)]
            requests.put((f"r{round_}", block_ids, salt))
            kind, *reply = replies.get(timeout=TIMEOUT_S)
            if kind == "error":
                return [f"FAIL cuda_ipc: {reply[0]}"]
            torch.cuda.synchronize()
            started = time.perf_counter()
            path = sender.begin(reply[0], list(range(src_blocks)))
            for layer in range(NUM_LAYERS):
                sender.send_layer(f"r{round_}", layer)
            elapsed = time.perf_counter() - started  # (each layer is synchronized before its header)
            event = SenderEvents(sender).wait(f"r{round_}", TIMEOUT_S)
            _, status, exact = replies.get(timeout=TIMEOUT_S)
            if path != "cuda_ipc" or event.status is not TransferStatus.DONE or status != "DONE" or not exact:
                return [f"FAIL cuda_ipc: round {round_} went by {path}, sender {event.status.name} "
                        f"({event.reason}), receiver {status}, bytes exact: {exact}"]
            if round_:
                seconds.append(elapsed)
        ipc_gbs = num_bytes / min(seconds) / 1e9
        copy_gbs = _device_copy_gbs(num_bytes)
        lines.append(f"PASS cuda_ipc: two processes on one GPU, the default layout ({NUM_LAYERS} layers x "
                     f"{NUM_KV_HEADS} kv heads x {HEAD_DIM}, bf16), {PROMPT_TOKENS} tokens into scattered blocks: "
                     f"byte-exact in {REPEATS + 1} rounds; IPC write {ipc_gbs:.1f} GB/s vs device copy "
                     f"{copy_gbs:.1f} GB/s ({ipc_gbs / copy_gbs:.0%}), {num_bytes / 2**20:.0f} MiB per prompt")
    except Exception as e:  # noqa: BLE001 - a bench line, not a crash
        lines.append(f"FAIL cuda_ipc: {type(e).__name__}: {e}")
    finally:
        if sender is not None:
            sender.close()
        requests.put(None)
        child.join(10)
        if child.is_alive():
            child.kill()
    return lines
