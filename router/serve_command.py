"""`tandem serve`: a local Ray (or an existing cluster), the workers, and the gRPC router in
front of them, until Ctrl-C. Torch-free: the workers load the model in their own processes."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Mapping

from tandem.config import EngineOptions, KVTransferConfig, WorkerConfig
from tandem.config.engine_options import ENGINE_DEFAULTS, add_engine_options, engine_options_from_args
from tandem.config.model_args import add_model_args, model_of
from tandem.kvtransfer.connectors.registry import kv_transports
from tandem.kvtransfer.curve import SECRET_ENV
from tandem.kvtransfer.path_choice import ALLOW_UNENCRYPTED_FLAG, PAIR_PATHS
from tandem.model.generation_defaults import GENERATION_CONFIG_CHOICES_HELP
from tandem.router.auth import (
    ADMIN_API_KEY_ENV,
    API_KEYS_ENV,
    AUTH_TOKEN_ENV,
    admin_key_from_env,
    api_keys_from_env,
)
from tandem.router.autoscale import AutoscaleConfig, SloWindow, parse_pool_bounds
from tandem.router.disagg import DEFAULT_MAX_LOCAL_STALL_S, DISAGG_POLICIES
from tandem.router.limits import add_limit_args, limits_from_args
from tandem.router.metrics_endpoint import DEFAULT_METRICS_PORT, METRICS_TOKEN_ENV
from tandem.router.placement import add_placement_args, placement_options
from tandem.router.policy import POLICIES
from tandem.router.pool_stats import log_pool_stats
from tandem.router.tls import TLSFiles
from tandem.worker.api import Role
from tandem.worker.step_priority import SERVING_NICENESS, lower_threads

logger = logging.getLogger(__name__)

REQUEST_LOGGERS = ("tandem.router.servicer", "tandem.router.openai.generation", "tandem.router.relay")
"""Whose per-request lines --disable-log-requests quiets."""
DEFAULT_HTTP_PORT = 8000
"""vLLM's and SGLang's habit: OpenAI clients pointed at a local server often try :8000 first."""


def add_args(parser: argparse.ArgumentParser) -> None:
    add_model_args(parser, served_names=True)
    parser.add_argument("--prefill", type=int, default=1, help="prefill workers (default 1)")
    parser.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    parser.add_argument("--colocated", type=int, nargs="?", const=1, default=0, metavar="N",
                        help="N workers that both prefill and decode, instead of the two pools (the baseline)")
    parser.add_argument("--prefill-tp", type=int, default=None, metavar="N",
                        help="tensor-parallel ranks per prefill worker, one device each (default: "
                             "--tensor-parallel-size)")
    parser.add_argument("--decode-tp", type=int, default=None, metavar="N",
                        help="tensor-parallel ranks per decode or colocated worker (default: --tensor-parallel-size)")
    parser.add_argument("--policy", default="least_loaded", choices=POLICIES, help="how workers are picked")
    parser.add_argument("--disagg-policy", default="auto", choices=tuple(DISAGG_POLICIES),
                        help="where each prompt is prefilled: always on the prefill pool, never (its decode worker "
                             "runs it, colocated behaviour on the same pools), or auto: on its decode worker when "
                             "that gives the first token sooner and stalls the worker's streams at most "
                             "--max-local-stall-ms (default %(default)s)")
    parser.add_argument("--max-local-stall-ms", type=float, default=DEFAULT_MAX_LOCAL_STALL_S * 1e3, metavar="MS",
                        help="auto: the most a local prefill may add to a busy decode worker's streams, in all "
                             "(default %(default)g)")
    parser.add_argument("--host", default="127.0.0.1", help="the router's address (default: loopback only)")
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT,
                        help=f"Prometheus /metrics on --host (default {DEFAULT_METRICS_PORT}): "
                             "the router's and every worker's")
    parser.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT,
                        help=f"the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models, "
                             f"/health) on --host (default {DEFAULT_HTTP_PORT}; -1: off)")
    parser.add_argument("--tls-certfile", default=None, help="serve gRPC and HTTP over TLS with this PEM certificate "
                                                             "(and --tls-keyfile)")
    parser.add_argument("--tls-keyfile", default=None, help="the PEM private key of --tls-certfile")
    parser.add_argument("--api-key", default=None,
                        help=f"calls must carry `authorization: Bearer <key>` with this key (as ${AUTH_TOKEN_ENV}; "
                             f"${API_KEYS_ENV} adds keys naming tenants)")
    parser.add_argument("--admin-api-key", default=None,
                        help=f"the only key the admin routes (tandem drain, scale, restart) take (default: "
                             f"${ADMIN_API_KEY_ENV}, else --api-key's key, never a tenant's from ${API_KEYS_ENV}); "
                             "without any, they are open where no API key is set, else off")
    parser.add_argument("--autoscale", action="append", default=[], metavar="POOL=MIN:MAX",
                        help="scale this pool between MIN and MAX workers from its queues, KV use and SLO "
                             "attainment, e.g. --autoscale decode=1:4 (repeat per pool; default: fixed pools)")
    parser.add_argument("--autoscale-slo", nargs=2, type=float, default=[4000.0, 200.0], metavar=("TTFT_MS", "TPOT_MS"),
                        help="the SLO the autoscaler keeps: time to first token (the prefill pool's) and per "
                             "output token (the decode pool's), in ms (default 4000 200)")
    parser.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                        help="the chat template to render messages with: a Jinja file, or the template itself "
                             "(default: the model's)")
    parser.add_argument("--disable-log-requests", action="store_true",
                        help="no log line per request (refusals, aborts), as vLLM's flag")
    parser.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                        help="requests' sampling defaults (temperature, top_p, top_k, min_p, repetition_penalty, "
                             f"max_tokens): {GENERATION_CONFIG_CHOICES_HELP} (default auto)")
    parser.add_argument("--address", default=None, help="join this Ray cluster instead of starting a local one")
    parser.add_argument("--pool-resources", action="store_true",
                        help="each worker asks Ray for the custom resource "
                             "tandem_prefill/tandem_decode/tandem_colocated, so it runs on a node started for its pool")
    add_placement_args(parser)  # --gpus-per-worker, --placement-timeout, --start-timeout
    parser.add_argument("--kv-transfer-host", default=None, metavar="HOST",
                        help="address decode workers receive KV on (default loopback; 'node-ip': the Ray node's "
                             "address, for pools on several hosts)")
    parser.add_argument("--kv-transport", default="auto", choices=kv_transports(),
                        help="how KV goes from prefill to decode workers: auto (default: in place through shared "
                             "memory on one host, CUDA IPC between two workers on one GPU, NCCL between GPUs, else "
                             "ZMQ), zmq (always ZMQ frames), gloo or nccl (a torch.distributed group per worker "
                             "pair, even on one host; two workers on one GPU still share by CUDA IPC)")
    parser.add_argument(ALLOW_UNENCRYPTED_FLAG, action="store_true",
                        help="with TANDEM_KV_SECRET set, still send KV by torch.distributed pairs (nccl, gloo), "
                             "which are NOT encrypted; without it such pairs are refused (auto then sends "
                             "CurveZMQ-encrypted frames between GPUs)")
    parser.add_argument("--kv-checksum", action="store_true",
                        help="a CRC-32 with every layer of KV sent: "
                             "corrupted KV fails its request instead of its output")
    parser.add_argument("--num-threads", type=int, default=None,
                        help="torch threads per worker (default: cores / workers)")
    add_engine_options(parser)  # each worker's engine: the same options as tandem chat's and LLM(...)'s
    add_limit_args(parser)


def check_kv_encryption(args: argparse.Namespace, env: Mapping[str, str]) -> None:
    """Refuse (ValueError) an explicit torch.distributed transport with TANDEM_KV_SECRET set
    here and not acknowledged: the KV would go unencrypted (path_choice.py). Workers that see
    the secret where this process does not refuse each pair the same way."""
    if args.kv_transport in PAIR_PATHS and env.get(SECRET_ENV) and not args.kv_allow_unencrypted_pairs:
        raise ValueError(f"--kv-transport {args.kv_transport} sends KV unencrypted, and TANDEM_KV_SECRET is set: "
                         f"add {ALLOW_UNENCRYPTED_FLAG} to allow that, or use --kv-transport auto or zmq "
                         "(CurveZMQ-encrypted frames)")


def read_chat_template(given: str | None) -> str | None:
    """--chat-template: a file's text, or the template itself (what has Jinja's braces)."""
    if given is None or "{" in given:
        return given
    try:
        with open(given, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"--chat-template: cannot read {given!r}: {e.strerror}") from None


def worker_config(args: argparse.Namespace) -> WorkerConfig:
    """Each worker's settings from the flags; a bad one refused before any worker starts.

    Only the engine options that differ from their defaults are given: a worker builds its
    engine with the same defaults (tandem.config.engine_options), and its config shows what was asked."""
    if args.num_speculative_tokens < 0:
        raise ValueError(f"--num-speculative-tokens must be >= 0, got {args.num_speculative_tokens}")
    options = engine_options_from_args(args)
    del options["tensor_parallel_size"]  # per pool: see pool_tp
    kv_transfer = KVTransferConfig(transport=args.kv_transport, checksum=args.kv_checksum,
                                   allow_unencrypted_pairs=args.kv_allow_unencrypted_pairs,
                                   receiver_host=args.kv_transfer_host)
    return WorkerConfig(model=model_of(args), revision=args.revision, device=options.pop("device"),
                        dtype=options.pop("dtype"), num_threads=args.num_threads,
                        generation_config=args.generation_config, kv_transfer=kv_transfer,
                        engine=EngineOptions.of({k: v for k, v in options.items() if v != ENGINE_DEFAULTS[k]}))


def pool_tp(args: argparse.Namespace) -> tuple[int, int]:
    """(prefill, decode) tensor-parallel sizes: each pool's own flag, else --tensor-parallel-size."""
    both = args.tensor_parallel_size
    return (both if args.prefill_tp is None else args.prefill_tp, both if args.decode_tp is None else args.decode_tp)


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_serve(args))


async def _serve(args: argparse.Namespace) -> int:
    import ray

    from tandem.router.autoscaler import Autoscaler
    from tandem.router.cluster import ClusterConfig, start_cluster, stop_cluster
    from tandem.router.server import bound_port, drain, http_port, metrics_port, serve

    limits = limits_from_args(args)  # refuse bad limits (and TLS files) before any worker starts
    autoscale = autoscale_config_of(args)
    tls = TLSFiles.of(args.tls_certfile, args.tls_keyfile)
    chat_template = read_chat_template(args.chat_template)
    prefill_tp, decode_tp = pool_tp(args)
    if args.disable_log_requests:
        for name in REQUEST_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
    check_kv_encryption(args, os.environ)
    if not args.max_local_stall_ms >= 0:
        raise ValueError(f"--max-local-stall-ms must be >= 0, got {args.max_local_stall_ms:g}")
    cfg = ClusterConfig(num_prefill=args.prefill, num_decode=args.decode, colocated=args.colocated,
                        policy=args.policy, disagg_policy=args.disagg_policy,
                        max_local_stall_s=args.max_local_stall_ms / 1e3, address=args.address,
                        worker=worker_config(args),
                        pool_resources=args.pool_resources, prefill_tp=prefill_tp, decode_tp=decode_tp,
                        log_level=args.log_level, **placement_options(args))
    mode = f"{cfg.colocated} colocated" if cfg.colocated else f"{cfg.num_prefill} prefill + {cfg.num_decode} decode"
    print(f"tandem: starting {mode} worker(s); each loads the model...", file=sys.stderr, flush=True)
    backend = await start_cluster(cfg)
    # The router's threads (and those it starts later) below the workers' steps: on a host
    # where they share cores, the step comes first (tandem/worker/step_priority.py).
    lower_threads(SERVING_NICENESS)
    backend.start_polling()
    stats = asyncio.create_task(log_pool_stats(lambda: [w.load for w in backend.workers if w.load is not None]))
    keys = api_keys_from_env(args.api_key)
    server = await serve(backend, args.host, args.port, metrics_port=args.metrics_port, auth_token=keys,
                        limits=limits, http_port=None if args.http_port < 0 else args.http_port, tls=tls,
                        metrics_token=os.environ.get(METRICS_TOKEN_ENV) or None,
                        served_model_names=args.served_model_name, chat_template=chat_template,
                        admin_key=admin_key_from_env(args.admin_api_key, args.api_key))
    autoscaler = None
    if autoscale is not None:
        assert backend.pool_changes is not None and backend.metrics is not None  # start_cluster's, serve's
        autoscaler = Autoscaler(backend.pool_changes, autoscale,
                                SloWindow(args.autoscale_slo[0] / 1000, args.autoscale_slo[1] / 1000))
        backend.metrics.slo_window = autoscaler.slo
        autoscaler.start()
    scheme = "http" if tls is None else "https"
    where = f"{args.host}:{bound_port(server)}"
    print(f"tandem: serving {backend.tokenizer_spec.model_name} on {where} (gRPC tandem.v1.Generation)"
          f"{f', a key from ${AUTH_TOKEN_ENV} or ${API_KEYS_ENV} required' if keys else ''}\n"
          f"  metrics: http://{args.host}:{metrics_port(server)}/metrics\n"
          + (f"  OpenAI API: {scheme}://{args.host}:{http_port(server)}/v1 "
             "(e.g. openai.OpenAI(base_url=..., api_key=...))\n"
             if http_port(server) is not None else "") +
          f"  try:  tandem generate --server {where}{'' if tls is None else ' --tls-ca CA.pem'} "
          "\"What is the capital of France?\" --chat\n"
          f"  or:   grpcurl -plaintext -d '{{\"prompt\": \"Hello\"}}' {where} tandem.v1.Generation/Generate\n"
          "  Ctrl-C stops", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    print("tandem: draining...", file=sys.stderr, flush=True)
    stats.cancel()
    if autoscaler is not None:
        await autoscaler.stop()
    await drain(server, grace=5.0)
    stop_cluster(backend)
    ray.shutdown()
    print("tandem: stopped", file=sys.stderr, flush=True)
    return 0



def autoscale_config_of(args: argparse.Namespace) -> AutoscaleConfig | None:
    """What --autoscale asks for (None without it); ValueError for bad bounds or a pool the
    cluster will not have."""
    if not args.autoscale:
        return None
    bounds = dict(parse_pool_bounds(text) for text in args.autoscale)
    pools = {Role.COLOCATED} if args.colocated else {Role.PREFILL, Role.DECODE}
    if other := [role.value for role in bounds if role not in pools]:
        raise ValueError(f"--autoscale {other[0]}=...: this cluster has no {other[0]} pool")
    return AutoscaleConfig(bounds)
