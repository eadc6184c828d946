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


def spec_plots(result: dict, json_path: str) -> list[str]:
    """Speculative decoding's speed-up and mean acceptance length against batch size, and a
    markdown table beside the JSON report."""
    stem = os.path.splitext(json_path)[0]
    sizes = result["workload"]["batch_sizes"]
    runs = result["runs"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for name, r in runs.items():
        if name == "none":
            continue
        ax1.plot(sizes, [r[f"batch_{b}"]["speedup"] for b in sizes], "o-", label=name)
        mal = [r[f"batch_{b}"]["speculative_decoding"]["mean_acceptance_length"] for b in sizes]
        ax2.plot(sizes, [m if m is not None else float("nan") for m in mal], "s-", label=name)
    ax1.axhline(1.0, color="gray", lw=1, ls="--")
    for ax, label in ((ax1, "speed-up (output tok/s over no speculation)"),
                      (ax2, "mean acceptance length")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.set_xlabel("batch size (concurrent requests)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"speculative decoding, {result['workload']['dataset']} workload")
    png = f"{stem}.png"
    fig.savefig(png, dpi=100, bbox_inches="tight")
    plt.close(fig)
    lines = [f"# Speculative decoding: {result['engine']['model']}", "",
             f"Command: `{result.get('command', '')}`  ", f"Date: {result.get('date', '')}  ",
             f"Machine: {result.get('machine', '')}", "",
             "| config | batch | output tok/s | speed-up | mean acceptance length | same outputs |",
             "|---|---|---|---|---|---|"]
    for name, r in runs.items():
        for b in sizes:
            x = r[f"batch_{b}"]
            sd = x.get("speculative_decoding") or {}
            mal = sd.get("mean_acceptance_length")
            lines.append(f"| {name} | {b} | {x['output_tokens_per_s']:.1f} | "
                         f"{x['speedup']:.2f}x | {'-' if mal is None else f'{mal:.2f}'} | "
                         f"{x['same_outputs']}/{x['requests']} |" if name != "none" else
                         f"| {name} | {b} | {x['output_tokens_per_s']:.1f} | 1 | - | - |")
    lines += ["", f"![{os.path.basename(png)}]({os.path.basename(png)})"]
    md = f"{stem}.md"
    with open(md, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {png} and {md}")
    return [png, md]
