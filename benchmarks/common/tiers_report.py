"""The printed table and the plot of `benchmarks/tiers.py`: each source's TTFT against span-cold
and stock, its load bandwidth against its medium's ceiling, and the copy-time bound."""
from __future__ import annotations

import argparse
from typing import Any

from common import format_table, save_figure


def report(args: argparse.Namespace, out: dict[str, Any]) -> None:
    res, ceil = out["results"], out["ceiling_GBps"]
    rc, st = res["recompute"]["ttft_s"], res["stock"]["ttft_s"]
    rows = []
    for name, r in res.items():
        bw = r.get("load_GBps")
        rows.append([name, r["ttft_s"], rc / r["ttft_s"], st / r["ttft_s"], r.get("load_s", "-"),
                     bw if bw is not None else "-", r.get("copy_GBps", "-"), ceil.get(name, "-"),
                     f"{bw / ceil[name]:.0%}" if bw is not None and ceil.get(name) else "-",
                     r["reuse"].get("segment", 0), r["reuse"].get("computed", 0)])
    print(format_table(["source", "TTFT s", "x span-cold", "x stock", "load s", "load GB/s", "copy GB/s",
                        "ceiling GB/s", "of ceiling", "segment tok", "computed tok"], rows))
    print("warm-up requests (dropped): " + ", ".join(f"{n} {r['warmup_s']:.3f} s" for n, r in res.items()))
    if "host" in res and res["host"].get("block_copies_GBps"):
        h = res["host"]
        print(f"host loads: copies into the pool at {h['copy_GBps']:.3g} GB/s, from {h['upload_runs']} host runs; "
              f"pinned link {ceil['host']:.3g} GB/s as one copy, {h['block_copies_GBps']:.3g} GB/s one block per copy")
    b = out["bounds"]
    if b:
        print(f"copy-time lower bound (host bytes / pinned-copy ceiling): {b['copy_s']:.3f} s: at most "
              f"{b['max_x_recompute']:.1f}x span-cold and {b['max_x_stock']:.1f}x stock; followed by the "
              f"pool-resident request ({b['copy_then_pool_s']:.3f} s): {b['max_x_recompute_with_step']:.1f}x "
              f"and {b['max_x_stock_with_step']:.1f}x")
    print(f"break-even bandwidth (layout KV / span-cold recompute time): {out['break_even_GBps']:.3g} GB/s "
          f"for {out['kv_bytes'] / 2**30:.2f} GiB")


def plot(out: dict[str, Any], name: str, title: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = out["results"]
    fig, ax = plt.subplots(figsize=(6.4, 3.2))
    names = list(res)
    colors = {"stock": "#666", "recompute": "#999", "pool": "#4a7"}
    ax.bar(names, [res[n]["ttft_s"] for n in names], color=[colors.get(n, "#47a") for n in names])
    if out["bounds"]:
        ax.axhline(out["bounds"]["copy_s"], color="#c33", lw=1, ls="--", label="copy-time lower bound")
        ax.legend(fontsize=8)
    ax.set_ylabel("TTFT (s)")
    ax.set_title(title, fontsize=9)
    return str(save_figure(fig, name))
