"""PNG plots (matplotlib, no display) and a markdown summary beside each serving report."""
from __future__ import annotations

import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def serve_plots(runs: list[dict], result: dict, json_path: str) -> list[str]:
    stem = os.path.splitext(json_path)[0]
    paths = []
    if len(runs) > 1:
        fig, ax = plt.subplots(figsize=(6, 4))
        conc = [r["max_concurrency"] or 0 for r in runs]
        ax.plot(conc, [r["output_throughput"] for r in runs], "o-", label="output tok/s")
        ax.plot(conc, [r["total_token_throughput"] for r in runs], "s--", label="total tok/s")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max concurrency")
        ax.set_ylabel("tokens / s")
        ax.set_title("throughput against concurrency")
        ax.legend()
        ax.grid(alpha=0.3)
        paths.append(f"{stem}_throughput.png")
        fig.savefig(paths[-1], dpi=100, bbox_inches="tight")
        plt.close(fig)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "_ttft_all", "TTFT (ms)"), (axes[1], "_tpot_all", "TPOT (ms)")):
        for r in runs:
            values = [v * 1e3 for v in r[key]]
            if values:
                ax.hist(values, bins=30, alpha=0.5, label=f"concurrency {r['max_concurrency'] or 'inf'}")
        ax.set_xlabel(label)
        ax.set_ylabel("requests")
        ax.legend(fontsize=8)
    fig.suptitle("latency distributions")
    paths.append(f"{stem}_latency.png")
    fig.savefig(paths[-1], dpi=100, bbox_inches="tight")
    plt.close(fig)

    lines = [f"# Serving benchmark: {result['model']}", "",
             f"Command: `{result.get('command', '')}`  ", f"Date: {result.get('date', '')}  ",
             f"Machine: {result.get('machine', '')}  ", f"Server: {result['base_url']}", "",
             "| max concurrency | ok | failed | req/s | output tok/s | total tok/s | TTFT mean/p99 ms "
             "| TPOT mean/p99 ms | ITL mean/p99 ms | E2E mean/p99 ms | KV waste % | peak seqs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        mem = r.get("memory") or {}
        cell = lambda k: f"{r[k]['mean']:.1f} / {r[k]['p99']:.1f}"  # noqa: E731
        lines.append(f"| {r['max_concurrency'] or 'inf'} | {r['successful_requests']} | "
                     f"{r['failed_requests']} | {r['request_throughput']:.2f} | "
                     f"{r['output_throughput']:.1f} | {r['total_token_throughput']:.1f} | "
                     f"{cell('ttft_ms')} | {cell('tpot_ms')} | {cell('itl_ms')} | {cell('e2e_ms')} | "
                     f"{mem.get('kv_waste_perc', float('nan')):.2f} | {mem.get('peak_running_seqs', '-')} |")
    if runs and runs[-1].get("memory"):
        m = runs[-1]["memory"]
        lines += ["", f"Static max-length preallocation ({m['max_model_len']} tokens a sequence) "
                  f"would admit {m['static_prealloc_seqs']} sequences in the same "
                  f"{m['kv_total_slots']} KV slots; the paged cache held {m['peak_running_seqs']} at once."]
    lines += [""] + [f"![{os.path.basename(p)}]({os.path.basename(p)})" for p in paths]
    md = f"{stem}.md"
    with open(md, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {md} and {len(paths)} plot(s)")
    return paths + [md]
