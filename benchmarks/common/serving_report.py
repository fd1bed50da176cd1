"""The tables `benchmarks/serving.py` prints last: each load's runs, the ShareGPT summary against
the offline engine, the decode roofline by batch size and the sustained RAG rates."""
from __future__ import annotations

from typing import Any

from common import format_table


def report(r: dict[str, Any]) -> None:
    heads = ["load", "rate/s", "req/s", "out tok/s", "TTFT p50 s", "TTFT p99 s", "ITL p50 ms", "ITL p99 ms",
             "cached", "ok"]

    def row(kind: str, x: dict[str, Any]) -> list[Any]:
        return [kind, "sat" if x["offered_rate"] is None else x["offered_rate"], x["requests_per_s"],
                x["output_tokens_per_s"], x["ttft_p50_s"], x["ttft_p99_s"], 1e3 * x["itl_p50_s"],
                1e3 * x["itl_p99_s"], f"{x['cached_fraction']:.0%}", f"{x['ok']}/{x['requests']}"]

    rows = [row("chat", x) for x in r.get("chat", [])]
    rag = r.get("rag", {})
    rows += [row(f"rag {m}", x) for m in ("span", "plain") for x in rag.get(m, [])]
    print("\n" + format_table(heads, rows))
    if "sharegpt" in r:
        s = r["sharegpt"]
        off = s.get("offline_output_tok_s")
        print(f"\nShareGPT load: server {s['output_tok_s']:.0f} output tok/s, {s['requests_per_s']:.2f} req/s"
              + (f"; offline engine {off:.0f} tok/s: server/offline = {s['output_tok_s'] / off:.1%}" if off else ""))
        print("decode-only steps, fraction of the weights + KV bandwidth bound: " + ", ".join(
            f"batch {b} {f:.0%}" if f is not None else f"batch {b} none" for b, f in r["decode_roofline"].items()))
    if "offline" in r and r.get("chat"):
        sat, off = r["chat"][-1], r["offline"]
        print(f"\nsaturation, same {off['requests']} requests: server {sat['output_tokens_per_s']:.0f} output tok/s, "
              f"offline engine {off['output_tokens_per_s']:.0f} tok/s: server/offline = "
              f"{sat['output_tokens_per_s'] / off['output_tokens_per_s']:.1%}")
    for name in ("server", "offline"):
        roof = r.get("roofline", {}).get(name)
        if roof:
            print(f"\ndecode-only steps ({name}) against (weights + KV bytes) / {r['model']['copy_gbps']:.0f} GB/s:")
            print(format_table(["batch", "steps", "mean batch", "step ms", "roofline ms", "of roofline"],
                               [[x["batch"], x["steps"], x["mean_batch"], x["step_ms"], x["roofline_ms"],
                                 f"{x['fraction_of_roofline']:.0%}"] for x in roof]))
    sus = rag.get("sustained")
    if sus:
        s, p = sus.get("span"), sus.get("plain")
        desc = lambda x: "none" if x is None else f"{x['rate']} req/s (p99 TTFT {x['ttft_p99_s']:.2f} s)" + (  # noqa: E731
            ", highest rate tried" if x["capped"] else "")
        print(f"\nRAG, highest Poisson rate with p99 TTFT <= {rag['slo_ttft_p99_s']} s: span layouts {desc(s)}; "
              f"plain prompts {desc(p)}" + (f"; span/plain = {'>= ' if s['capped'] else ''}{s['rate'] / p['rate']:.1f}x"
                                            if s and p else ""))
