"""The ``tandem`` command: ``serve`` (the cluster), ``generate`` (a gRPC client), ``chat`` (one engine
in this process), ``plan`` (KV capacity before loading), ``simulate`` (a virtual clock) and ``bench``."""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
import os
import sys
from typing import Any

from tandem.config.engine_options import MODEL_HELP, add_engine_options, engine_options_from_args
from tandem.config.model_args import add_model_args, model_of
from tandem.config.option_sources import add_config_arg, option_defaults
from tandem.sampling_params import SamplingParams


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """``tandem chat``'s flags for its one engine: the model, torch threads and every engine
    option (the same definitions as ``tandem serve``'s, see tandem.config.engine_options)."""
    add_model_args(parser)
    parser.add_argument("--num-threads", type=int, default=None, help="torch threads (default: torch's choice)")
    add_engine_options(parser)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """LLM(...)'s keywords from add_engine_args' flags."""
    return dict(model=model_of(args), revision=args.revision, num_threads=args.num_threads,
                **engine_options_from_args(args))


def chat(args: argparse.Namespace) -> int:
    """Answer --prompt and exit, or chat on stdin until EOF (one engine, no cluster)."""
    from tandem.llm import LLM

    llm = LLM(**engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    if args.prompt is not None:
        for delta in llm.stream(llm.apply_chat_template([{"role": "user", "content": args.prompt}]), params):
            print(delta.new_text, end="", flush=True)
        print()
        return 0
    messages: list[dict[str, str]] = []
    print("tandem: chat with the model (Ctrl-D to quit)", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        reply = ""
        for delta in llm.stream(llm.apply_chat_template(messages), params):
            reply += delta.new_text
            print(delta.new_text, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": reply})


def generate(args: argparse.Namespace) -> int:
    """Stream one completion from a running router to stdout; usage to stderr at the end.
    With --n > 1 each completion is printed whole, under a header with its index, as soon as
    it finishes (their tokens arrive interleaved)."""
    import grpc

    from tandem.proto import generation_pb2 as pb
    from tandem.router.client import FINISH_REASON_NAMES, GenerationClient, build_request, describe_error

    temperature = args.temperature
    if args.beam_search and temperature is None:
        temperature = 0.0  # beam search is deterministic: the server refuses its default 1.0
    request = build_request(
        args.prompt, chat=args.chat, max_tokens=args.max_tokens, temperature=temperature,
        top_p=args.top_p, top_k=args.top_k, seed=args.seed, n=args.n,
        use_beam_search=True if args.beam_search else None, beam_width=args.beam_width,
    )
    several = (args.n or 1) > 1
    with GenerationClient(args.server, tls_ca=args.tls_ca) as client:
        call = client.generate(request, timeout=args.timeout)
        last = None
        texts: dict[int, list[str]] = {}
        try:
            for response in call:
                last = response
                if several:
                    texts.setdefault(response.index, []).append(response.text)
                    if response.finish_reason != pb.FINISH_REASON_UNSPECIFIED:  # the completion's last message
                        reason = FINISH_REASON_NAMES.get(response.finish_reason, "unknown")
                        print(f"--- [{response.index}] finish_reason={reason}\n{''.join(texts.pop(response.index))}",
                              flush=True)
                    continue
                sys.stdout.write(response.text)
                sys.stdout.flush()
        except grpc.RpcError as e:
            print(file=sys.stdout)
            print(f"tandem: error: {describe_error(e)}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            call.cancel()  # the server aborts the request on the workers
            print(file=sys.stdout)
            return 130
    if not several:
        print()
    if last is not None and last.HasField("usage"):
        # With n > 1 each completion's finish_reason was printed with it; this is the last one's.
        reason = FINISH_REASON_NAMES.get(last.finish_reason, "unknown")
        print(f"[{last.request_id}] finish_reason={reason} prompt_tokens={last.usage.prompt_tokens} "
              f"completion_tokens={last.usage.completion_tokens}", file=sys.stderr)
    return 0


def health(args: argparse.Namespace) -> int:
    """Print a router's health status; exit 0 when SERVING (a probe's command)."""
    import grpc

    from tandem.router.client import describe_error, health_status

    try:
        status = health_status(args.server, args.service, args.tls_ca, args.tls_server_name)
    except grpc.RpcError as e:
        print(f"tandem: error: {describe_error(e)}", file=sys.stderr)
        return 1
    print(status)
    return 0 if status == "SERVING" else 1


def plan(args: argparse.Namespace) -> int:
    """Print one rank's weights, KV memory and KV capacity, from the model's config alone."""
    from tandem.plan import make_plan

    if args.slo is not None or args.distserve:
        from tandem.sim.plan_command import run as plan_slo

        return plan_slo(args)
    if args.memory is None:
        raise ValueError("tandem plan needs --memory GIB (or --slo KEY:MS ... to search placements)")
    weights = None if args.weights_memory == "auto" else float(args.weights_memory)
    try:
        result = make_plan(args.model, args.memory, tp=args.tp, dtype=args.dtype, block_size=args.block_size,
                           max_model_len=args.max_model_len, weights_memory_gib=weights, device=args.device,
                           gpu_memory_utilization=args.gpu_memory_utilization,
                           max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                           kv_cache_dtype=args.kv_cache_dtype)
    except OSError as e:  # no such model, or an unreadable config
        raise ValueError(str(e)) from None
    print("\n".join(result.lines()))
    return 0


def auto_or_gib(value: str) -> str:
    """--weights-memory: "auto", or a number of GiB."""
    if value != "auto":
        float(value)  # argparse reports a ValueError here as an invalid value
    return value


BENCH_HELP = {
    "engine": "tandem vs transformers generate: throughput, single-stream TPOT; decode steps vs the memory floor",
    "step": "one decode step's time by part (projections, attention, sampling, Python) beside its memory floor",
    "kernels": "attention kernels vs scaled_dot_product_attention",
    "transfer": "KV transfer between processes vs a memory copy",
    "serve": "a load generator against disaggregated and colocated clusters",
    "compare": "OpenAI-compatible servers (tandem, llama.cpp, ...) on the same seeded workload, side by side",
    "prefix": "multi-turn chat: prefix_aware vs least_loaded routing, TTFT and KV bytes sent",
    "overload": "10x the sustainable rate against a bounded router: outcomes, memory, recovery",
    "swap": "preemption: swapping KV blocks out and in vs recomputing their tokens",
    "lone": "a lone stream through `tandem serve` against the bare engine step, side by side: TPOT and its ratio",
    "spec": "speculative decoding by prompt lookup: tokens/s and acceptance, with vs without",
    "quant": "weight-only int8 and int4 vs float32 and bfloat16: decode tokens/s, weight bytes, agreement",
    "detokenize": "incremental detokenization: tokenizers' DecodeStream vs the window technique, per token",
    "grammar": "structured outputs: xgrammar, llguidance, outlines-core compile and per-token mask times",
    "gpu": "on a GPU: greedy parity with transformers, decode vs the memory floor, kernels vs SDPA, KV staging",
    "kv-dtype": "a bfloat16 KV cache vs the activations' float32: greedy token agreement on parity prompts",
    "activations": "quantized weights' products with int8 vs float32 activations on the CPU: perplexity, agreement",
}


def run_bench(name: str, args: argparse.Namespace) -> int:
    module = importlib.import_module(f"tandem.bench.{name.replace('-', '_')}")
    parser = argparse.ArgumentParser(prog=f"tandem bench {name}", description=module.__doc__)
    module.add_args(parser)
    return module.run(parser.parse_args(args.bench_args))


def download(args: argparse.Namespace) -> int:
    """Resolve a hub model as a worker would (the cache first, then the hub); print its directory."""
    from tandem.model.source import HUB_ID, resolve_model_source

    if not HUB_ID.match(args.model):
        raise ValueError(f"{args.model!r} is not a hub id (org/name)")
    try:
        print(resolve_model_source(args.model, args.revision).path)
    except FileNotFoundError as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 1
    return 0


def heartbeat_check(args: argparse.Namespace) -> int:
    from tandem.worker.heartbeat_file import stale_heartbeats

    stale = stale_heartbeats(args.directory, args.max_age)
    for name, age in sorted(stale.items()):
        print(f"{name}: engine loop silent for {age:.0f} s", file=sys.stderr)
    return 1 if stale else 0


OPTION_SOURCES = ("serve", "chat")
"""The commands whose flags may also come from --config and the environment."""


def _subcommands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def build_parser() -> argparse.ArgumentParser:
    """Every `tandem` command and its flags."""
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    commands = parser.add_subparsers(dest="command", required=True)

    from tandem.router import serve_command

    p = commands.add_parser("serve", help="start the cluster (Ray workers + gRPC router) on the model",
                            description=serve_command.__doc__)
    serve_command.add_args(p)
    add_config_arg(p)
    p.set_defaults(func=serve_command.run)

    p = commands.add_parser("chat", help="one engine in this process: answer --prompt, or chat on stdin")
    add_engine_args(p)
    add_config_arg(p)
    p.add_argument("--prompt", default=None, help="answer this one message and exit")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.set_defaults(func=chat)  # (--seed, an engine option, seeds its requests too)

    p = commands.add_parser("generate", help="stream a completion from a running router (gRPC)")
    p.add_argument("prompt", help="the prompt (with --chat: one user message)")
    p.add_argument("--server", default="127.0.0.1:50051", help="the router's host:port")
    p.add_argument("--tls-ca", default=None, help="connect over TLS, trusting this PEM CA file")
    p.add_argument("--max-tokens", type=int, default=None, help="default: the server's")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--n", type=int, default=None,
                   help="completions to return (default 1); with --beam-search the n best")
    p.add_argument("--beam-search", action="store_true",
                   help="beam search instead of sampling (temperature 0 unless set)")
    p.add_argument("--beam-width", type=int, default=None,
                   help="beams kept per step with --beam-search (default: the server's)")
    p.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template")
    p.add_argument("--timeout", type=float, default=None, help="deadline of the call in seconds")
    p.set_defaults(func=generate)

    p = commands.add_parser("health", help="a router's grpc.health.v1 status; exit 0 when SERVING (for probes)")
    p.add_argument("--server", default="127.0.0.1:50051", help="the router's host:port")
    p.add_argument("--service", default="", help='"" (ready to serve), tandem.liveness (the router itself is alive)')
    p.add_argument("--tls-ca", default=None, help="connect over TLS, trusting this PEM CA file")
    p.add_argument("--tls-server-name", default=None, help="the name the router's certificate carries")
    p.set_defaults(func=health)

    from tandem.router import admin_command

    admin_command.add_commands(commands)  # tandem drain, scale, restart, node-run

    p = commands.add_parser("download", help="fetch a hub model into the local Hugging Face cache (what workers load)")
    p.add_argument("model", help="a Hugging Face hub id (org/name)")
    p.add_argument("--revision", default=None, help="a branch, tag or commit (default: main)")
    p.set_defaults(func=download)

    p = commands.add_parser("heartbeat-check",
                            help="exit 1 when a worker's engine loop on this host is stuck (for probes)")
    p.add_argument("directory", help="the workers' TANDEM_HEARTBEAT_DIR")
    p.add_argument("--max-age", type=float, default=180.0,
                   help="seconds without a beat that count as stuck (default 180: above the router's own "
                        "120 s bound for restarting a hung worker, so that it acts first)")
    p.set_defaults(func=heartbeat_check)

    p = commands.add_parser("plan", help="KV capacity per rank for a memory budget, before loading anything",
                            description=plan.__doc__)
    p.add_argument("--model", default=None, help=MODEL_HELP)
    p.add_argument("--memory", type=float, default=None, metavar="GIB",
                   help="memory per rank for weights and KV, in GiB (with --gpu-memory-utilization: the GPU's memory); "
                        "required without --slo")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    # As the engine would run: its flags and defaults.
    add_engine_options(p, ("device", "dtype", "kv_cache_dtype", "block_size", "gpu_memory_utilization",
                           "max_num_batched_tokens", "max_num_seqs"))
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--weights-memory", type=auto_or_gib, default="auto", metavar="auto|GIB",
                   help="weights per rank in GiB (default auto: parameters from the shapes x dtype bytes / tp)")
    from tandem.sim import plan_command

    plan_command.add_args(p)  # --slo: search placements by simulation
    p.set_defaults(func=plan)

    from tandem.sim import command as simulate_command

    p = commands.add_parser("simulate", help="the cluster's router and schedulers on a virtual clock, steps priced "
                            "by a model: the bench's report in seconds", description=simulate_command.__doc__)
    simulate_command.add_args(p)
    p.set_defaults(func=simulate_command.run)

    bench = commands.add_parser("bench", help="benchmarks (ratios measured side by side)")
    bench_commands = bench.add_subparsers(dest="bench", required=True)
    # The bench modules import torch: load only the one asked for.
    for name in BENCH_HELP:
        p = bench_commands.add_parser(name, help=BENCH_HELP[name], add_help=False)
        p.set_defaults(func=functools.partial(run_bench, name))
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with --config's and the environment's flags beneath it (serve, chat)."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command in OPTION_SOURCES:
        command = _subcommands(parser).choices[args.command]
        try:
            defaults = option_defaults(command, args.config, os.environ)
        except ValueError as e:
            parser.error(str(e))
        if defaults:
            command.set_defaults(**defaults)
            args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        args.bench_args = rest  # the bench's own parser reads them
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as e:
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
