"""KV transfer between two processes over IPC, TCP loopback, gloo and shared memory, against
a plain memory copy of the same bytes measured in the same run.

A spawned receiver process owns a KV pool shaped for the model (the layout only: no
weights; for shm, a second one in /dev/shm) and a KVReceiver per transport; this process
fills its own pool with random KV, sends every layer of a prompt's blocks and times first
send -> DONE. Then a real prefill sends each layer from the model's on_layer_stored hook,
to show how much of the transfer the compute hides. --quick is a tiny run (random weights).
Also: python -m tandem.bench.transfer
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from tandem.bench.transfers.remote import TRANSPORTS, RemoteReceiver
from tandem.bench.transfers.runs import BLOCK_SIZE, TIMEOUT_S, bench_overlap, bench_transfers
from tandem.config import EngineConfig, ModelConfig
from tandem.engine.model_runner import ModelRunner
from tandem.kvtransfer.sender import KVSender
from tandem.model.llama import LayerWeights, LlamaModel, ModelWeights
from tandem.model.loader import load_hf_config, load_model
from tandem.model.source import resolve_model_source

logger = logging.getLogger(__name__)

COPY_DEFINITION = ("copy GB/s = bytes / time of dst.copy_(src) over the same bytes in this process (best of 3 "
                   "back-to-back copies right before each transfer, median over the transfers); each byte is "
                   "read once and written once: bench engine's read+write bandwidth would be twice this")


@dataclass(frozen=True)
class Settings:
    """What one run does; ``--quick`` only changes the defaults."""

    prompt_lens: list[int]
    transports: list[str]
    block_orders: list[str]
    repeats: int
    overlap_lens: list[int]
    overlap_repeats: int
    random_weights: bool


GOALS = {"ipc": 0.5, "shm": 0.8}
"""Bandwidth goals, as fractions of the copy: through a socket, and written in place."""

FULL = Settings([512, 2048, 8192], list(TRANSPORTS), ["contiguous", "shuffled"], 5, [512, 2048, 8192], 3, False)
QUICK = Settings([64, 256], list(TRANSPORTS), ["contiguous", "shuffled"], 2, [64], 1, True)


def add_args(parser: argparse.ArgumentParser) -> None:
    """Options of ``tandem bench transfer``; unset ones take FULL's (or QUICK's) value."""
    parser.add_argument("--model", default=None,
                        help="local HF directory or .gguf file (default: embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--quick", action="store_true", help="tiny run: prompts of 64 and 256 tokens, random weights")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=None,
                        help="tokens per transfer (default: 512 2048 8192)")
    parser.add_argument("--transports", nargs="+", choices=TRANSPORTS, default=None, help="default: ipc tcp gloo shm")
    parser.add_argument("--block-orders", nargs="+", choices=["contiguous", "shuffled"], default=None,
                        help="block tables: one run of blocks (a fresh pool), or shuffled (a busy one)")
    parser.add_argument("--repeats", type=int, default=None, help="timed transfers per point, median kept (default: 5)")
    parser.add_argument("--overlap-lens", type=int, nargs="*", default=None,
                        help="prompt lengths of the prefill-overlap runs over ipc, none to skip "
                             "(default: 512 2048 8192)")
    parser.add_argument("--random-weights", action="store_true", default=None,
                        help="prefill with random weights of the model's shape (no weight load)")
    parser.add_argument("--num-threads", type=int, default=None,
                        help="torch threads of this process (default: all cores)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default="bench-results/transfer", help="where results.json and the PNG go")


def settings_from_args(args: argparse.Namespace) -> Settings:
    base = QUICK if args.quick else FULL
    pick = lambda value, default: default if value is None else value  # noqa: E731
    s = Settings(list(pick(args.prompt_lens, base.prompt_lens)), list(pick(args.transports, base.transports)),
                 list(pick(args.block_orders, base.block_orders)), pick(args.repeats, base.repeats),
                 list(pick(args.overlap_lens, base.overlap_lens)), base.overlap_repeats,
                 pick(args.random_weights, base.random_weights))
    if min(s.prompt_lens + s.overlap_lens) < 1 or s.repeats < 1:
        raise ValueError("prompt lengths and repeats must be >= 1")
    if s.overlap_lens and "ipc" not in s.transports:
        raise ValueError("the prefill-overlap runs send over ipc: add it to --transports, or pass --overlap-lens alone")
    return s


def random_weights(cfg: ModelConfig, seed: int) -> ModelWeights:
    """Weights of the model's shapes drawn at random: the same compute as the real ones."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g) * 0.02  # noqa: E731
    q, kv, h = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.hidden_size
    layers = [LayerWeights(rand(q + 2 * kv, h), rand(q + 2 * kv) if cfg.attention_bias else None, rand(h, q),
                           rand(2 * cfg.intermediate_size, h), rand(h, cfg.intermediate_size), torch.ones(h),
                           torch.ones(h)) for _ in range(cfg.num_layers)]
    embed = rand(cfg.vocab_size, h)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim))
    return ModelWeights(embed, layers, torch.ones(h), embed, inv_freq, 1.0)


def prefill_runner(args: argparse.Namespace, s: Settings, cfg: ModelConfig) -> ModelRunner:
    """A model runner whose pool holds the longest overlap prompt (real or random weights)."""
    if s.random_weights:
        weights = random_weights(cfg, args.seed)
    else:
        loaded = load_model(resolve_model_source(args.model), torch.float32)
        cfg, weights = loaded.config, loaded.weights
    longest = max(s.overlap_lens)
    config = EngineConfig.build(cfg, num_kv_blocks=-(-longest // BLOCK_SIZE), block_size=BLOCK_SIZE,
                                max_model_len=longest, max_num_batched_tokens=longest)
    return ModelRunner(config, LlamaModel(cfg, weights, config.max_model_len))


def run(args: argparse.Namespace) -> int:
    s = settings_from_args(args)
    threads = args.num_threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    torch.manual_seed(args.seed)
    source = resolve_model_source(args.model)
    cfg = ModelConfig.from_hf_config(load_hf_config(source), source.name, ())
    logger.info("bench transfer (%s): %s, %d torch threads here, 1 in the receiver; %s",
                "quick" if args.quick else "full", cfg.name, threads, s)
    pool_blocks = -(-max(s.prompt_lens + s.overlap_lens) // BLOCK_SIZE)
    shape = (cfg.num_layers, 2, pool_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    runner = prefill_runner(args, s, cfg) if s.overlap_lens else None
    with tempfile.TemporaryDirectory(prefix="tandem-kv-") as ipc_dir:
        remote = RemoteReceiver(shape, s.transports, ipc_dir, TIMEOUT_S)
        try:
            # "default" sends over every transport but gloo: by frames, or in place to the shm receiver.
            senders = {"default": KVSender(torch.randn(shape), TIMEOUT_S)}
            if remote.gloo:
                senders["gloo"] = KVSender(senders["default"].kv_cache, TIMEOUT_S, transport="gloo")
            transfers = bench_transfers(remote, senders, cfg, s.prompt_lens, s.transports, s.block_orders,
                                        s.repeats, np.random.default_rng(args.seed))
            for sender in senders.values():
                sender.close()
            overlap = bench_overlap(runner, remote, s.overlap_lens, s.overlap_repeats, cfg.vocab_size,
                                    args.seed) if runner else []
        finally:
            remote.close()
    results = {"model": cfg.name, "weights": "random" if s.random_weights else "real", "dtype": "float32",
               "layout": {"num_layers": cfg.num_layers, "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
                          "block_size": BLOCK_SIZE},
               "num_threads": threads, "receiver_threads": 1, "torch": torch.__version__, "quick": args.quick,
               "settings": asdict(s), "copy_definition": COPY_DEFINITION, "transfers": transfers, "overlap": overlap}
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    plot = write_plot(results, out_dir)
    print_report(results)
    print(f"\nwrote {out_dir / 'results.json'}, {plot}")
    return 0


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def print_report(r: dict) -> None:
    """The transfer table (with the ratio to the copy) and the prefill-overlap table, with the goals."""
    lay, s = r["layout"], r["settings"]
    print(f"\n== tandem bench transfer: {r['model']} KV ({lay['num_layers']} layers x {lay['num_kv_heads']} KV heads "
          f"x {lay['head_dim']}, {r['dtype']}, blocks of {lay['block_size']}); {r['num_threads']} torch threads here, "
          f"{r['receiver_threads']} in the receiver process; torch {r['torch']} ==")
    print("bytes = 2 (K, V) x layers x tokens x KV heads x head dim x 4; latency = first send_layer call -> "
          f"the receiver's DONE event, median of {s['repeats']} (after a checked warm-up); GB/s = bytes / latency")
    print(f"{r['copy_definition']};\nwith {r['num_threads']} threads and with 1; ratio = GB/s / the faster "
          "of the two (the goal's), ratio 1t = GB/s / the 1-thread copy. "
          f"send calls = time in the {lay['num_layers']} send_layer calls; "
          "sender ack = first send -> DONE seen by the sender\n")
    rows = [[t["transport"], t["block_order"], str(t["num_tokens"]), f"{t['bytes'] / 1e6:.1f}",
             f"{t['latency_s'] * 1e3:.2f}", f"{t['send_calls_s'] * 1e3:.2f}", f"{t['ack_s'] * 1e3:.2f}",
             f"{t['bytes_per_s'] / 1e9:.2f}", f"{t['copy_bytes_per_s'] / 1e9:.2f}", f"{t['copy_ratio']:.0%}",
             f"{t['copy_1t_bytes_per_s'] / 1e9:.2f}", f"{t['copy_1t_ratio']:.0%}"] for t in r["transfers"]]
    print(_table(["transport", "blocks", "tokens", "MB", "latency ms", "send calls ms", "sender ack ms", "GB/s",
                  "copy GB/s", "ratio", "copy 1t GB/s", "ratio 1t"], rows))
    print()
    for transport, goal in GOALS.items():
        runs = [t for t in r["transfers"] if t["transport"] == transport]
        if runs:
            verdicts = ", ".join(f"{t['block_order']} {t['num_tokens']}: {t['copy_ratio']:.0%} "
                                 f"{'ok' if t['copy_ratio'] >= goal else 'MISSED'}" for t in runs)
            print(f"goal, {transport} >= {goal:.0%} of copy bandwidth: {verdicts}")
    if not r["overlap"]:
        return
    print(f"\nprefill + transfer over ipc, each layer sent from on_layer_stored ({r['weights']} weights), "
          f"medians of {s['overlap_repeats']} after a warm-up, alternating with the same prefill without sending "
          "(alone);\ntransfer = layer 0 stored -> receiver DONE; tail = prefill step end -> DONE (the goal's "
          "measure), and last layer stored -> DONE, as % of transfer\n")
    rows = [[str(o["num_tokens"]), f"{o['bytes'] / 1e6:.1f}", f"{o['prefill_alone_s'] * 1e3:.1f}",
             f"{o['prefill_s'] * 1e3:.1f}", f"{o['transfer_s'] * 1e3:.1f}", f"{o['tail_s'] * 1e3:.2f}",
             f"{o['tail_fraction']:.1%}", f"{o['tail_after_last_stored_s'] * 1e3:.2f}",
             f"{o['tail_after_last_stored_fraction']:.1%}"] for o in r["overlap"]]
    print(_table(["tokens", "MB", "prefill alone ms", "prefill sending ms", "transfer ms", "tail ms", "tail %",
                  "after last stored ms", "%"], rows))
    verdicts = ", ".join(f"{o['num_tokens']}: {o['tail_fraction']:.1%} {'ok' if o['tail_fraction'] < 0.1 else 'MISSED'}"
                         for o in r["overlap"])
    print(f"\ngoal, tail < 10% of the transfer: {verdicts}")


def write_plot(r: dict, out_dir: Path) -> Path:
    """transfer.png: GB/s against prompt length per transport with the copy as a line, and
    the prefill/transfer timelines of the overlap runs. -> its path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 2 if r["overlap"] else 1
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 5), squeeze=False)
    ax = axes[0][0]
    for i, transport in enumerate(dict.fromkeys(t["transport"] for t in r["transfers"])):
        for order, style in (("contiguous", "o-"), ("shuffled", "x--")):
            rows = [t for t in r["transfers"] if t["transport"] == transport and t["block_order"] == order]
            if rows:
                ax.plot([t["num_tokens"] for t in rows], [t["bytes_per_s"] / 1e9 for t in rows], style,
                        color=f"C{i}", label=f"{transport}, {order} blocks")
    lens = sorted({t["num_tokens"] for t in r["transfers"]})
    copy = [statistics.median(max(t["copy_bytes_per_s"], t["copy_1t_bytes_per_s"]) for t in r["transfers"]
                              if t["num_tokens"] == n) for n in lens]
    ax.plot(lens, [b / 1e9 for b in copy], "k-", label="memory copy, same bytes (the faster of N threads and 1)")
    for transport, goal in GOALS.items():
        ax.plot(lens, [b * goal / 1e9 for b in copy], ":", color="k", alpha=0.3 + goal / 3,
                label=f"{goal:.0%} of copy ({transport} goal)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(lens, [str(n) for n in lens])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("GB/s (bytes / latency), log scale")
    ax.set_yscale("log")
    ax.set_title(f"KV transfer between processes, {r['model']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3)
    if r["overlap"]:
        ax = axes[0][1]
        for y, o in enumerate(r["overlap"]):
            pct = lambda seconds: 100 * seconds / o["prefill_s"]  # noqa: E731  (of this prompt's step)
            ax.barh(y + 0.2, 100, height=0.35, color="C0", label="prefill step" if y == 0 else None)
            ax.barh(y - 0.2, pct(o["transfer_s"]), left=pct(o["first_stored_s"]), height=0.35, color="C1",
                    label="transfer (layer 0 stored -> DONE)" if y == 0 else None)
            end = pct(o["first_stored_s"] + o["transfer_s"])
            ax.annotate(f" tail {o['tail_fraction']:.1%}", (end, y - 0.2), fontsize=7, va="center")
        ax.set_yticks(range(len(r["overlap"])), [f"{o['num_tokens']} tok" for o in r["overlap"]])
        ax.set_xlabel("% of the prefill step's time (step start = 0)")
        ax.set_xlim(0, 125)
        ax.set_title("Layer-wise overlap (ipc)")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    path = out_dir / "transfer.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description=__doc__)
    add_args(parser)
    raise SystemExit(run(parser.parse_args()))
