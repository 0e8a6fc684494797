"""The tables and the plot of ``tandem bench kernels`` (from the dict written to results.json):
decode and prefill attention, store_kv and the weight-only GEMVs, and on a CPU the compiled
decode kernel's own table (tandem.bench.cpu_decode)."""

from __future__ import annotations

from pathlib import Path

from tandem.bench.cpu_decode import print_cpu_decode


def print_report(r: dict) -> None:
    decode_backend = r.get("decode_backend", r["backend"])
    print(f"\n{r['device']}, {r['backend']} kernels (decode attention: {decode_backend}), {r['dtype']}; "
          f"copy bandwidth {r['copy_bandwidth']['bytes_per_s'] / 1e9:.1f} GB/s")
    has_fa = any("flash_attn_s" in row for row in r["decode"])
    print("\ndecode attention (fraction of copy bandwidth; speedup = sdpa time / tandem time)")
    print(f"{'batch':>6} {'context':>8} {'tandem ms':>10} {'tandem bw':>10} {'sdpa ms':>9} {'sdpa bw':>8}"
          f" {'speedup':>8}" + (f" {'flash ms':>9}" if has_fa else ""))
    for row in r["decode"]:
        print(f"{row['batch']:>6} {row['context_len']:>8} {row['tandem_s'] * 1e3:>10.3f} "
              f"{row['tandem_bw_fraction']:>10.0%} {row['sdpa_s'] * 1e3:>9.3f} {row['sdpa_bw_fraction']:>8.0%} "
              f"{row['speedup_vs_sdpa']:>7.2f}x"
              + (f" {row.get('flash_attn_s', float('nan')) * 1e3:>9.3f}" if has_fa else ""))
    print("\nprefill attention (causal, no prefix)")
    print(f"{'batch':>6} {'seq len':>8} {'tandem ms':>10} {'TFLOP/s':>8} {'sdpa ms':>9} {'TFLOP/s':>8} {'speedup':>8}")
    for row in r["prefill"]:
        print(f"{row['batch']:>6} {row['seq_len']:>8} {row['tandem_s'] * 1e3:>10.3f} {row['tandem_tflops']:>8.2f} "
              f"{row['sdpa_s'] * 1e3:>9.3f} {row['sdpa_tflops']:>8.2f} {row['speedup_vs_sdpa']:>7.2f}x")
    print("\nstore_kv")
    for row in r["store_kv"]:
        print(f"{row['num_tokens']:>6} tokens {row['tandem_s'] * 1e3:>9.3f} ms "
              f"{row['tandem_bw_fraction']:>5.0%} of copy bandwidth")
    print("\nweight-only gemv (bandwidth: the quantized weight's bytes; dense: F.linear on a float weight)")
    print(f"{'kind':>5} {'rows':>5} {'N x K':>12} {'tandem ms':>10} {'tandem bw':>10} {'dense ms':>9} "
          f"{'dense bw':>9} {'speedup':>8}")
    for row in r.get("gemv", []):
        shape = f"{row['n']}x{row['k']}"
        print(f"{row['kind']:>5} {row['rows']:>5} {shape:>12} {row['tandem_s'] * 1e3:>10.3f} "
              f"{row['tandem_bw_fraction']:>10.0%} {row['dense_s'] * 1e3:>9.3f} {row['dense_bw_fraction']:>9.0%} "
              f"{row['speedup_vs_dense']:>7.2f}x")
    if r.get("cpu_decode"):
        print_cpu_decode(r["cpu_decode"], r["dtype"])


def write_plot(r: dict, out_dir: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, batch in enumerate(sorted({row["batch"] for row in r["decode"]})):
        rows = [row for row in r["decode"] if row["batch"] == batch]
        ctx = [row["context_len"] for row in rows]
        ax.plot(ctx, [row["tandem_bw_fraction"] for row in rows], "o-", color=f"C{i}", label=f"tandem, batch {batch}")
        ax.plot(ctx, [row["sdpa_bw_fraction"] for row in rows], "x--", color=f"C{i}", alpha=0.6,
                label=f"sdpa, batch {batch}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("fraction of copy bandwidth")
    ax.set_ylim(bottom=0)
    ax.set_title(f"Decode attention, {r['device']}, {r['dtype']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    path = out_dir / "decode_bandwidth.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
