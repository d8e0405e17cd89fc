"""PNG plots of the bench results (matplotlib, imported lazily, Agg backend: no display needed)."""

from __future__ import annotations

from typing import Any


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def write_plot(bench: str, result: dict[str, Any], path: str) -> None:
    """Write the plot of ``bench``'s result to ``path`` (PNG)."""
    plotters = {"generate": plot_generate, "engine": plot_engine, "kernels": plot_kernels,
                "hotpath": plot_hotpath}
    if bench not in plotters:
        raise ValueError(f"no plot for bench {bench!r}")
    plotters[bench](result, path)


def _save(plt, fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _bars(ax, labels: list[str], series: dict[str, list[float]], ylabel: str, title: str, fmt: str = "{:.2f}") -> None:
    n = len(series)
    width = 0.8 / max(n, 1)
    xs = list(range(len(labels)))
    for k, (name, values) in enumerate(series.items()):
        pos = [x - 0.4 + width * (k + 0.5) for x in xs]
        bars = ax.bar(pos, values, width, label=name)
        for bar, v in zip(bars, values, strict=True):
            ax.annotate(fmt.format(v), (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                        va="bottom", fontsize=7)
    ax.set_xticks(xs)
    ax.set_xticklabels(labels)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    if n > 1:
        ax.legend(fontsize=8)


def plot_generate(result: dict[str, Any], path: str) -> None:
    plt = _pyplot()
    cases = list(result["cases"])
    c = result["cases"]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
    _bars(ax_t, [f"{k} ({c[k]['new_tokens']} new)" for k in cases],
          {"unpatched": [c[k]["seconds_unpatched"] for k in cases],
           "flashpage.patch": [c[k]["seconds_patched"] for k in cases]},
          "seconds (lower is better)", "generate() wall time")
    mib = 2 ** 20
    _bars(ax_m, cases,
          {"dense (DynamicCache)": [c[k]["dense_kv_bytes"] / mib for k in cases],
           "paged in use": [c[k]["paged_kv_bytes_in_use"] / mib for k in cases],
           "paged allocated": [c[k]["paged_kv_bytes_allocated"] / mib for k in cases],
           "bound (real tokens -> blocks)": [c[k]["kv_bound_bytes"] / mib for k in cases]},
          "MiB", "KV cache bytes at the end")
    fig.suptitle(f"bench generate: {result['model']}, batch {result['batch']}", fontsize=10)
    _save(plt, fig, path)


def plot_engine(result: dict[str, Any], path: str) -> None:
    plt = _pyplot()
    systems = result["systems"]
    labels = [s["label"] for s in systems.values()]
    fig, (ax_t, ax_l) = plt.subplots(1, 2, figsize=(12, 4.2))
    _bars(ax_t, labels, {"output tokens/s": [s["output_tokens_per_s"] for s in systems.values()]},
          "output tokens/s (higher is better)", "throughput", fmt="{:.0f}")
    metrics = [("ttft_p50_s", "TTFT p50"), ("ttft_p90_s", "TTFT p90"), ("tpot_p50_s", "TPOT p50"),
               ("tpot_p90_s", "TPOT p90")]
    _bars(ax_l, [m[1] for m in metrics],
          {s["label"]: [s[key] * 1e3 for key, _ in metrics] for s in systems.values()},
          "milliseconds (lower is better)", "latency", fmt="{:.0f}")
    ax_l.set_yscale("log")
    fig.suptitle(f"bench engine, {result['workload']}: {result['workload_description']}", fontsize=9)
    _save(plt, fig, path)


def plot_kernels(result: dict[str, Any], path: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 4))
    _bars(ax, ["paged (flashpage)", "dense SDPA"], {"ms": [result["paged_ms"], result["dense_sdpa_ms"]]},
          "milliseconds per decode step", f"{result['num_seqs']} seqs, lengths {result['min_len']}-{result['max_len']}",
          fmt="{:.1f}")
    _save(plt, fig, path)


def plot_hotpath(result: dict[str, Any], path: str) -> None:
    """One bar per case: flashpage's time relative to its comparison (lower is better)."""
    plt = _pyplot()
    labels, values = [], []
    for c in result["cases"]:
        labels.append(c["case"].replace(", ", "\n", 1))
        values.append(c["ratio"] if "ratio" in c else 1.0 / c["speedup"])
    fig, ax = plt.subplots(figsize=(10, 3.8))
    _bars(ax, labels, {"flashpage / baseline time": values}, "time ratio (lower is better)",
          "flashpage bench hotpath (baseline: transformers, or eager LLM for LLM compile)")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.tick_params(axis="x", labelsize=7)
    _save(plt, fig, path)
