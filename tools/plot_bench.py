#!/usr/bin/env python3
"""Draw a `loramux bench serve` result JSON (--result-json) as one PNG: per adapter (and the base model),
TTFT and TPOT median/p90/p99 bars, and output throughput with median OTPS. Invoked by
`bench serve --plot FILE.png`, or by hand:  python3 tools/plot_bench.py result.json out.png
Needs matplotlib (scripts/setup installs it into build/venv)."""
import json
import sys


def percentile_keys(result, metric):
    """(label, key) for median and every reported percentile of `metric` (e.g. ttft_ms), in order."""
    keys = [("median", f"median_{metric}")]
    for p in result.get("percentiles", []):
        word = str(int(p)) if float(p).is_integer() else str(p)
        keys.append((f"p{word}", f"p{word}_{metric}"))
    return keys


def main(argv):
    if len(argv) != 3:
        sys.stderr.write("usage: plot_bench.py RESULT.json OUT.png\n")
        return 2
    with open(argv[1]) as f:
        result = json.load(f)
    per_adapter = result.get("per_adapter") or {}
    if not per_adapter:
        sys.stderr.write(f"plot_bench.py: {argv[1]} has no per_adapter section (not a bench serve result?)\n")
        return 1
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(per_adapter)
    labels = [n + (" (base)" if per_adapter[n].get("is_base") else "") for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(6 + 1.8 * len(names), 4.5), constrained_layout=True)
    for ax, metric, title in ((axes[0], "ttft_ms", "TTFT (ms)"), (axes[1], "tpot_ms", "TPOT (ms)")):
        keys = percentile_keys(result, metric)
        width = 0.8 / len(keys)
        for k, (label, key) in enumerate(keys):
            xs = [i + (k - (len(keys) - 1) / 2) * width for i in range(len(names))]
            ax.bar(xs, [per_adapter[n].get(key, 0) for n in names], width, label=label)
        ax.set_xticks(range(len(names)), labels, rotation=30, ha="right")
        ax.set_title(title)
        ax.legend(fontsize="small")
    ax = axes[2]
    ax.bar(range(len(names)), [per_adapter[n].get("output_throughput", 0) for n in names], 0.6, color="tab:green")
    ax.set_xticks(range(len(names)), labels, rotation=30, ha="right")
    ax.set_title("output tok/s (label: median OTPS)", fontsize="medium")
    for i, n in enumerate(names):
        ax.annotate(f"{per_adapter[n].get('median_otps', 0):.1f}", (i, per_adapter[n].get("output_throughput", 0)),
                    ha="center", va="bottom", fontsize="small")
    concurrency = result.get("max_concurrency") or "unbounded"
    fig.suptitle(f"{result.get('model_id', '')} — {result.get('dataset_name', '')} in {result.get('input_len', '')} / "
                 f"out {result.get('output_len', '')}, concurrency {concurrency}, rate {result.get('request_rate', '')}; "
                 f"total {result.get('output_throughput', 0):.1f} tok/s, median OTPS {result.get('median_otps', 0):.1f}",
                 fontsize="medium")
    fig.savefig(argv[2], dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
