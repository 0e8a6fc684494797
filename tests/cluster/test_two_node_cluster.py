"""The pools on two real Ray nodes: a head and a second node started with `ray start` on this
machine (two raylets, at two node addresses), each offering one pool's resource, behind
`tandem serve --address <head> --pool-resources --kv-transfer-host node-ip`, run as an
operator runs it (a process of its own). Greedy output equals the single-process engine's,
both workers end at rest, the workers run on different nodes, and the KV went across: by
TCP to the decode node's address, and counted as the cross-node (zmq) path, not the
same-host shared-memory one.

Two nodes on one machine are still one host: this proves the cluster plumbing (placement by
pool resource, the receiver bound to its node's address, the prefill worker reaching it
there), not a network between machines. The KV sockets run CurveZMQ with the cluster's
secret (TANDEM_KV_SECRET): a sender without it gets no handshake from the decode worker."""

from __future__ import annotations

import concurrent.futures
import time

import pytest
import torch
from metrics_text import parse_samples, total
from reference import english_token_ids
from two_node_ray import (
    KV_SECRET,
    SECOND_NODE_IP,
    TANDEM,
    free_port,
    live_actors,
    nodes,
    scrape,
    tcp_links,
    two_node_ray,
    wait_for_line,
)

from tandem import SamplingParams
from tandem.kvtransfer.curve import CurveKeys
from tandem.kvtransfer.protocol import TransferRefused
from tandem.kvtransfer.sender import KVSender
from tandem.proto import generation_pb2 as pb
from tandem.router.client import GenerationClient
from tandem.worker.api import Role
from tandem.worker.host import pool_resource

pytestmark = pytest.mark.slow

PREFILL, DECODE = "prefill-0", "decode-0"
"""tandem serve's actor names (no prefix) for --prefill 1 --decode 1."""
LIGHT = ["--kv-cache-memory-gib", "0.1", "--max-num-batched-tokens", "256", "--num-threads", "1",
         "--quantization", "none"]
"""What the one-Ray cluster tests give their workers (tests/cluster/conftest.py)."""


def test_pools_on_two_ray_nodes(make_llm, tokenizer):
    began = time.monotonic()

    def phase(name: str) -> None:  # shown with the output when the test fails (or under -s)
        print(f"{time.monotonic() - began:6.1f} s  {name}", flush=True)

    prompts = [english_token_ids(tokenizer, n, skip=53 * i) for i, n in enumerate([4, 37, 100])]
    max_tokens = [8, 5, 6]
    with two_node_ray(head_resources={pool_resource(Role.PREFILL): 1},
                      node_resources={pool_resource(Role.DECODE): 1}) as ray_nodes:
        phase("both Ray nodes up")
        port, metrics_port = free_port(), free_port()
        serve = ray_nodes.popen("tandem-serve", [
            TANDEM, "serve", "--address", ray_nodes.address, "--pool-resources", "--kv-transfer-host", "node-ip",
            "--prefill", "1", "--decode", "1", "--disagg-policy", "always", "--host", "127.0.0.1", "--port", str(port),
            "--metrics-port", str(metrics_port), "--http-port", "-1", *LIGHT])
        # The reference while the workers load the model.
        expected = [o.token_ids for o in make_llm().generate(
            prompts, [SamplingParams(temperature=0, max_tokens=n) for n in max_tokens])]
        phase("reference computed")
        wait_for_line(serve, "tandem: serving", timeout=600)
        phase("tandem serve ready")
        # Ray's logging config carries the log level to the workers, on either node, and their
        # lines reach tandem serve's console (its KV pool, its readiness).
        for instance in (PREFILL, DECODE):
            wait_for_line(serve, f"worker {instance} ready on", timeout=60)

        # Each worker on the node that offers its pool's resource: two different nodes.
        actors = live_actors(ray_nodes.address)
        by_id = nodes(ray_nodes.address)
        assert len(by_id) == 2, by_id
        prefill, decode = actors[PREFILL], actors[DECODE]
        assert prefill.node_id != decode.node_id
        assert pool_resource(Role.PREFILL) in by_id[prefill.node_id]["Resources"]
        assert pool_resource(Role.DECODE) in by_id[decode.node_id]["Resources"]
        assert decode.node_ip == SECOND_NODE_IP and prefill.node_ip != SECOND_NODE_IP

        probe = ray_nodes.inventory_probe(prefill.namespace, [PREFILL, DECODE])  # connects meanwhile
        with GenerationClient(f"127.0.0.1:{port}", auth_token="") as client:
            def greedy(i: int) -> list[int]:
                request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompts[i]),
                                             sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens[i]))
                return [t for r in client.generate(request, timeout=300) for t in r.token_ids]

            with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
                got = list(pool.map(greedy, range(len(prompts))))
        assert got == expected
        phase("greedy requests done")

        # Every worker at rest: every block free, nothing held for any request.
        assert probe.leaks() == {PREFILL: [], DECODE: []}
        phase("workers at rest")

        # --kv-transfer-host node-ip: the decode worker receives KV on its node's address, and
        # the prefill worker (on the other node) is connected to it there.
        listening, _ = tcp_links(decode.pid)
        _, connected = tcp_links(prefill.pid)
        receivers = {a for a in listening if a[0] == SECOND_NODE_IP} & connected
        assert receivers, (listening, connected)

        # CurveZMQ: a sender without the secret gets no answer; one with it gets the receiver's
        # (a refusal here: this pool's layout is not the decode worker's).
        (host, receiver_port), = receivers
        for curve in (None, CurveKeys.from_secret(KV_SECRET)):
            outsider = KVSender(torch.zeros(1, 2, 1, 1, 1, 1), curve=curve)
            try:
                with pytest.raises(TimeoutError if curve is None else TransferRefused):
                    outsider.connect(f"tcp://{host}:{receiver_port}", timeout_s=2)
            finally:
                outsider.close()
        phase("KV sockets: CURVE only")

        # ...and counted it as the cross-node path: ZMQ frames, not the same-host shared memory.
        samples = parse_samples(scrape(metrics_port))
        assert total(samples, "tandem_worker_up") == 2
        assert total(samples, "tandem_request_success_total") == len(prompts)
        assert total(samples, "tandem_kv_transfer_bytes_total", role="prefill", direction="sent") > 0
        paths = {p: total(samples, "tandem_kv_transfer_paths_total", role="prefill", path=p)
                 for p in ("zmq", "shm", "dist")}
        assert paths == {"zmq": len(prompts), "shm": 0, "dist": 0}, paths
        stopping = time.monotonic()
    phase(f"stopped (in {time.monotonic() - stopping:.1f} s)")
