"""`tandem bench gpu`: the checks and timings that wait for a GPU, in one command.

1. Greedy parity with transformers on the device, both in float32 (bfloat16 is not
   token-exact with anything), on a few chat prompts.
1b. The default ``tandem serve`` on this GPU (both pools on one device: KV by CUDA IPC)
   answering a burst of mixed greedy requests token-exact with transformers (serve_check.py);
   the CUDA IPC write timed against a device copy (ipc.py); the NCCL rows (a KV pair on two
   GPUs, tensor parallelism) where there are enough GPUs, a line saying why not where not;
   the sampling step on the device (sampling.py).
2. Single-stream and batched decode steps in the serving dtype, against the memory floor
   (weights + KV read per step / the device's measured copy bandwidth).
3. The attention and KV-store kernels (Triton on CUDA) against torch's SDPA, on the model's
   own attention shapes.
2b. The same decode steps eager (``--enforce-eager``) against replayed CUDA graphs: step
   times, the capture's time and memory (against the memory plan's estimate), whether the
   greedy tokens agree (graphs.py).
4. The KV staging copy of one layer (device <-> pinned host buffer, on a side stream)
   against the device's copy bandwidth and a large pinned copy (the host link's ceiling).

Writes results.json to --out-dir. On a machine without CUDA it says so and exits 0.
Prints a PASS, FAIL or SKIP line per check. Exit 1 when a check fails (the timings still run
and are written).
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from pathlib import Path

import torch

from tandem.config.engine_options import MODEL_HELP

logger = logging.getLogger(__name__)


def add_args(parser: argparse.ArgumentParser) -> None:
    """Options of ``tandem bench gpu``."""
    parser.add_argument("--model", default=None, help=MODEL_HELP)
    parser.add_argument("--device", default="cuda", help="cuda or cuda:N (default cuda)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                        help="the timed engine's dtype (default auto: bfloat16, float16 where unsupported); "
                             "parity always runs in float32")
    parser.add_argument("--parity-tokens", type=int, default=32, help="greedy tokens compared per prompt (default 32)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64],
                        help="decode batch sizes timed (default 1 8 32 64; 1 is the single stream)")
    parser.add_argument("--prompt-len", type=int, default=128, help="prompt tokens of each timed request (default 128)")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens of each timed request (default 128)")
    parser.add_argument("--copy-mib", type=int, default=1024, help="device copy bandwidth probe size (default 1024)")
    parser.add_argument("--serve-requests", type=int, default=32,
                        help="requests of the burst sent to `tandem serve` (default 32; 0 skips the serve checks)")
    parser.add_argument("--serve-tokens", type=int, default=32, help="greedy tokens of each (default 32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default="bench-results/gpu", help="where results.json goes")


def cuda_missing() -> str | None:
    """Why this process cannot run the GPU checks, or None when it sees a CUDA device."""
    if torch.cuda.is_available():
        return None
    cuda = torch.version.cuda
    build = "a CPU-only build" if cuda is None else f"built for CUDA {cuda}, no device visible"
    return f"torch {torch.__version__} ({build})"


def run(args: argparse.Namespace) -> int:
    missing = cuda_missing()
    if missing is not None:
        print(f"tandem bench gpu: no CUDA device here ({missing}): nothing to check or time; "
              "run it on a machine with a GPU")
        return 0
    if min(args.batch_sizes) < 1 or args.prompt_len < 1 or args.output_len < 2 or args.parity_tokens < 1:
        raise ValueError("batch sizes, --prompt-len and --parity-tokens must be >= 1, --output-len >= 2")
    from tandem.bench.bandwidth import measure_copy_bandwidth
    from tandem.bench.gpu import attention, decode, graphs, ipc, parity, sampling, staging
    from tandem.bench.gpu.setup import load_for_gpu

    start = time.perf_counter()
    setup = load_for_gpu(args.model, args.device, args.dtype)
    logger.info("loaded %s in %.1f s; device %s (%s), timed dtype %s", setup.name, time.perf_counter() - start,
                setup.device, torch.cuda.get_device_name(setup.device), setup.dtype_name)
    results: dict = {"model": setup.name, "device": torch.cuda.get_device_name(setup.device),
                     "torch": torch.__version__, "cuda": torch.version.cuda, "dtype": setup.dtype_name}
    results["parity"] = parity.check(setup, args.parity_tokens)
    parity.release(setup)  # the float32 copies on the device: not needed by the timings
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    results["serve"] = serve_rows(setup, args, out_dir)
    results["ipc"] = ipc.run_ipc_check()
    results["sampling"] = sampling.check(setup)
    bandwidth = measure_copy_bandwidth(args.copy_mib, 5, device=str(setup.device))
    results["bandwidth"] = bandwidth.as_dict()
    results["decode"] = decode.bench(setup, args.batch_sizes, args.prompt_len, args.output_len, args.seed,
                                     bandwidth.bytes_per_s)
    results["graphs"] = graphs.bench(setup, args.batch_sizes, args.prompt_len, args.output_len, args.seed)
    results["kernels"] = attention.bench(setup, bandwidth.bytes_per_s)
    results["staging"] = staging.bench(setup, args.prompt_len, bandwidth.bytes_per_s)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    for line in report(results):
        print(line)
    print(f"wrote {out_dir / 'results.json'}")
    passed = results["parity"]["exact"] and all(r.get("exact", True) for r in results["serve"])
    lines = results["ipc"] + results["sampling"]
    return 0 if passed and not any(line.startswith("FAIL") for line in lines) else 1


SERVE_ROWS = (
    # (name, GPUs needed, flags added to the default `tandem serve`)
    ("default, one GPU", 1, ()),
    ("KV pair over NCCL", 2, ("--gpus-per-worker", "1", "--kv-transport", "nccl")),
    ("tensor parallel decode x2, KV over NCCL", 3,
     ("--gpus-per-worker", "1", "--decode-tp", "2", "--kv-transport", "nccl")),
)


def serve_rows(setup, args: argparse.Namespace, out_dir: Path) -> list[dict]:
    """Each SERVE_ROWS row this machine has the GPUs for (the others: skipped, with the reason)."""
    from tandem.bench.gpu import serve_check

    rows: list[dict] = []
    for i, (name, num_gpus, flags) in enumerate(SERVE_ROWS):
        row: dict = {"name": name}
        if args.serve_requests < 1:
            row["skipped"] = "--serve-requests 0"
        elif torch.cuda.device_count() < num_gpus:
            row["skipped"] = f"needs {num_gpus} GPUs, this machine has {torch.cuda.device_count()}"
        else:
            logger.info("serve check: %s", name)
            row.update(serve_check.check(setup, args.model, args.serve_requests, args.serve_tokens, args.seed,
                                         out_dir / f"serve-{i}.log", flags))
        rows.append(row)
    return rows


def report(r: dict) -> list[str]:
    """The human-readable lines of a results dict."""
    p = r["parity"]
    lines = [f"{r['model']} on {r['device']} (torch {r['torch']}, CUDA {r['cuda']}), timed in {r['dtype']}",
             f"greedy parity with transformers, float32: {p['num_exact']}/{p['num_prompts']} prompts token-exact "
             f"over {p['num_tokens']} tokens" + ("" if p["exact"] else f" FAILED ({p['diagnosis']})"),
             *serve_lines(r.get("serve", [])), *r.get("ipc", []), *r.get("sampling", []),
             f"device copy bandwidth: {r['bandwidth']['bytes_per_s'] / 1e9:.0f} GB/s"]
    for row in r["decode"]:
        lines.append(f"decode batch {row['batch']:>3}: step {row['step_s'] * 1e3:7.2f} ms, "
                     f"{row['tokens_per_s']:8.0f} tok/s, {row['floor_fraction']:.0%} of the memory floor "
                     f"({row['floor_s'] * 1e3:.2f} ms)")
    lines += graph_lines(r.get("graphs"))
    for row in r["kernels"]:
        vs = f", SDPA {row['sdpa_s'] * 1e6:.1f} us ({row['speedup_vs_sdpa']:.2f}x)" if "sdpa_s" in row else ""
        bw = f", {row['bw_fraction']:.0%} of copy bandwidth" if "bw_fraction" in row else ""
        lines.append(f"kernel {row['kernel']:<8} {row['shape']:<26} tandem {row['tandem_s'] * 1e6:8.1f} us{vs}{bw}")
    for row in r["staging"]:
        lines.append(f"KV staging {row['direction']} ({row['bytes'] / 2**20:.2f} MiB, one layer of "
                     f"{row['tokens']} tokens): {row['bytes_per_s'] / 1e9:.1f} GB/s, "
                     f"{row['device_fraction']:.1%} of device copy, {row['link_fraction']:.0%} of a large pinned copy")
    return lines


def graph_lines(g: dict | None) -> list[str]:
    """The eager-against-graphs rows (none where they did not run)."""
    if not g:
        return []
    lines = [f"CUDA graphs: {len(g['sizes'])} buckets (up to {max(g['sizes'])}) captured in {g['capture_s']:.1f} s, "
             f"{g['capture_bytes'] / 2**20:.0f} MiB (planned {g['planned_bytes'] / 2**20:.0f} MiB)"]
    for row in g["rows"]:
        lines.append(f"decode batch {row['batch']:>3}: eager {row['eager_step_s'] * 1e3:7.2f} ms, graphs "
                     f"{row['graph_step_s'] * 1e3:7.2f} ms ({row['speedup']:.2f}x; {row['replays']} replays), "
                     f"greedy tokens {'agree' if row['tokens_agree'] else 'DIFFER'}")
    return lines


def serve_lines(rows: list[dict]) -> list[str]:
    """A PASS, FAIL or SKIP line per serve check."""
    lines = []
    for row in rows:
        if "skipped" in row:
            lines.append(f"SKIP tandem serve, {row['name']}: {row['skipped']}")
        elif "error" in row:
            lines.append(f"FAIL tandem serve, {row['name']}: {row['error']}")
        else:
            paths = ", ".join(f"{p} {int(n)}" for p, n in sorted(row["paths"].items())) or "none"
            lines.append(f"{'PASS' if row['exact'] else 'FAIL'} tandem serve, {row['name']}: "
                         f"{row['num_exact']}/{row['num_requests']} mixed greedy requests token-exact with "
                         f"transformers ({row['num_tokens']} tokens each, burst served in {row['serve_s']:.1f} s, "
                         f"started in {row['start_s']:.0f} s); KV transfers by path: {paths}")
    return lines
