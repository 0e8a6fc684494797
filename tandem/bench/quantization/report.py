"""The table and the plot of ``tandem bench quant`` (results.json's rows, ratios against float32)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a bench machine
import matplotlib.pyplot as plt  # noqa: E402


def print_report(results: dict) -> None:
    """The table of every variant, ratios against float32."""
    bw = results["bandwidth"]
    print(f"\n== tandem bench quant: {results['model']}, {results['num_threads']} torch threads, torch "
          f"{results['torch']}; {results['num_seqs']} sequences x {results['max_tokens']} greedy tokens, "
          f"{results['rounds']} round(s); perplexity over {results['ppl_tokens']} tokens ==")
    print("decode tok/s: from the 2nd decode step on; read MB: weights one decode step reads; held MB: all weights\n"
          "(with int4's CPU kernel copy); floor: (read MB + mean KV read per step) / copy bandwidth, util: floor /\n"
          "measured step time; forced agree: float32's greedy tokens picked given float32's prefix; same tokens:\n"
          f"free-running. Copy bandwidth {bw['bytes_per_s'] / 1e9:.2f} GB/s ({bw['size_bytes'] >> 20} MiB, "
          f"best of {bw['repeats']}, {bw['num_threads']} threads)\n"
          "float32 is the model as loaded: for the default model, whose file is Q4_1 already, the int4 rows\n"
          "measure bf16 arithmetic in the int4 products and the int8 head, not 4-bit loss (docs/quantization.md)\n")
    print(f"{'variant':>10} {'decode tok/s':>12} {'vs f32':>7} {'read MB':>8} {'vs f32':>7} {'held MB':>8} "
          f"{'step ms':>8} {'floor ms':>8} {'util':>6} {'forced agree':>12} {'same tokens':>11} {'perplexity':>10} "
          f"{'vs f32':>8}")
    for r in results["rows"]:
        print(f"{r['variant']:>10} {r['decode_tok_s']:>12.1f} {r['tok_s_ratio']:>6.2f}x {r['read_bytes'] / 1e6:>8.1f} "
              f"{r['bytes_ratio']:>6.3f}x {r['held_bytes'] / 1e6:>8.1f} {r['step_s'] * 1e3:>8.2f} "
              f"{r['floor_s'] * 1e3:>8.2f} {r['floor_utilisation']:>6.1%} {r['forced_agreement']:>12.1%} "
              f"{r['same_tokens']:>11.1%} {r['perplexity']:>10.3f} {r['perplexity_rel_diff']:>+8.2%}")


def write_plot(results: dict, path: Path) -> None:
    """Decode tokens/s, weight bytes and memory-floor utilisation per variant."""
    rows = results["rows"]
    names = [r["variant"] for r in rows]
    fig, (speed, size, util) = plt.subplots(1, 3, figsize=(15, 4))
    speed.bar(names, [r["decode_tok_s"] for r in rows])
    speed.set_title(f"decode tokens/s ({results['num_seqs']} sequences)")
    size.bar(names, [r["read_bytes"] / 1e6 for r in rows], label="read per decode step")
    size.bar(names, [(r["held_bytes"] - r["read_bytes"]) / 1e6 for r in rows],
             bottom=[r["read_bytes"] / 1e6 for r in rows], label="held too (embedding table, int4 CPU copy)")
    size.set_title("weight MB")
    size.legend()
    util.bar(names, [100 * r["floor_utilisation"] for r in rows])
    util.set_title(f"memory-floor utilisation % ({results['bandwidth']['bytes_per_s'] / 1e9:.1f} GB/s copy)")
    for ax in (speed, size, util):
        ax.tick_params(axis="x", labelrotation=30)
    fig.suptitle(f"weight-only int8 / int4, {results['model']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
