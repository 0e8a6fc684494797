"""The default ``tandem serve`` on this machine's GPU, checked as a user would meet it.

``tandem serve`` starts in a process of its own with its default placement (one prefill and
one decode worker: on a one-GPU host both on the same device, so the KV goes by CUDA IPC),
in float32 with float weights (``--dtype float32 --quantization none``) so that its greedy
output can be compared token for token with transformers'. A burst of mixed requests (most
short, a quarter long) goes to it at once over gRPC; each stream's tokens must equal
transformers' greedy tokens for the same prompt on the same GPU. The router's /metrics then
says which KV data path the transfers took.
"""

from __future__ import annotations

import concurrent.futures
import logging
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import numpy as np

from tandem.bench.gpu import parity
from tandem.bench.gpu.setup import GpuSetup
from tandem.bench.workload import allowed_token_ids, excluded_token_ids
from tandem.proto import generation_pb2 as pb
from tandem.proto import generation_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 120.0
SHORT_TOKENS, LONG_TOKENS = (16, 200), (800, 1500)
PATH_SAMPLE = re.compile(r'^tandem_kv_transfer_paths_total\{[^}]*path="([a-z_]+)"[^}]*\} ([0-9.e+]+)$', re.M)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def mixed_prompts(setup: GpuSetup, num_requests: int, seed: int) -> list[list[int]]:
    """``num_requests`` prompts of random ordinary tokens: every fourth one long (800-1500
    tokens, several prefill chunks and many KV blocks), the rest short (16-200)."""
    rng = np.random.default_rng(seed)
    allowed = allowed_token_ids(setup.config.vocab_size,
                                excluded_token_ids(setup.tokenizer, setup.config.eos_token_ids))
    out = []
    for i in range(num_requests):
        low, high = LONG_TOKENS if i % 4 == 3 else SHORT_TOKENS
        out.append([int(t) for t in rng.choice(allowed, size=int(rng.integers(low, high + 1)))])
    return out


def check(setup: GpuSetup, model: str | None, num_requests: int, num_tokens: int, seed: int, log_path: Path,
          serve_args: tuple[str, ...] = ()) -> dict:
    """``serve_args``: flags added to the default command (the NCCL rows' placement).
    -> {"exact", "num_exact", "num_requests", "num_tokens", "paths" (transfers by KV data
    path), "serve_s" (the burst's wall time), "start_s", "first_difference"} (or "error")."""
    prompts = mixed_prompts(setup, num_requests, seed)
    eos = set(setup.config.eos_token_ids)
    reference = [parity.strip_eos(t, eos) for t in parity.transformers_greedy(setup, prompts, num_tokens)]
    parity.release(setup)  # the server's workers need the device more than the reference does
    port, metrics_port = free_port(), free_port()
    command = [sys.executable, "-m", "tandem", "serve", "--dtype", "float32", "--quantization", "none",
               "--port", str(port), "--metrics-port", str(metrics_port), "--http-port", "-1",
               *(["--model", model] if model else []), *serve_args]
    result: dict = {"num_requests": num_requests, "num_tokens": num_tokens, "command": " ".join(command[1:])}
    start = time.perf_counter()
    with open(log_path, "w") as log, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT) as server:
        try:
            channel = grpc.insecure_channel(f"127.0.0.1:{port}")
            _wait_ready(channel, server, START_TIMEOUT_S)
            result["start_s"] = time.perf_counter() - start
            stub = pb_grpc.GenerationStub(channel)
            t0 = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(num_requests) as pool:
                ours = list(pool.map(lambda ids: _generate(stub, ids, num_tokens), prompts))
            result["serve_s"] = time.perf_counter() - t0
            result["paths"] = _paths(metrics_port)
        except Exception as e:  # noqa: BLE001 - reported as the check's failure, with the server's log
            result.update(exact=False, error=f"{type(e).__name__}: {e} (server log: {log_path})")
            return result
        finally:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
    ours = [parity.strip_eos(t, eos) for t in ours]
    diverged = [parity.first_difference(a, b) for a, b in zip(ours, reference)]
    result.update(exact=all(d is None for d in diverged), num_exact=sum(d is None for d in diverged),
                  first_difference=diverged, prompt_lens=[len(p) for p in prompts])
    return result


def _wait_ready(channel: grpc.Channel, server: subprocess.Popen, timeout_s: float) -> None:
    """Until the router answers (its workers loaded), or the server exits, or the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"tandem serve exited with {server.returncode} before it served")
        try:
            grpc.channel_ready_future(channel).result(timeout=2)
            return
        except grpc.FutureTimeoutError:
            continue
    raise TimeoutError(f"tandem serve did not answer within {timeout_s:.0f} s")


def _generate(stub: pb_grpc.GenerationStub, prompt: list[int], num_tokens: int) -> list[int]:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt),
                                 sampling=pb.SamplingParams(temperature=0, max_tokens=num_tokens))
    tokens: list[int] = []
    for response in stub.Generate(request, timeout=REQUEST_TIMEOUT_S, wait_for_ready=True):
        tokens.extend(response.token_ids)
    return tokens


def _paths(metrics_port: int) -> dict[str, float]:
    """KV transfers begun, by data path, from the router's /metrics (its workers' included)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30) as response:
        return paths_of(response.read().decode())


def paths_of(text: str) -> dict[str, float]:
    """The non-zero tandem_kv_transfer_paths_total samples of a Prometheus text, summed by path."""
    paths: dict[str, float] = {}
    for path, value in PATH_SAMPLE.findall(text):
        paths[path] = paths.get(path, 0.0) + float(value)
    return {p: v for p, v in paths.items() if v}

