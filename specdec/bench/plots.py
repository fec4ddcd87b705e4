"""Bench plots (matplotlib, Agg): speedup and acceptance length by category, acceptance by draft
position, tokens/s per method with the min-max spread. A leaf: report.py imports from here (the summary's
`ALL` entry and category order too), never the other way."""

from __future__ import annotations

from pathlib import Path

ALL = "all"  # the summary's entry over every category
PLAIN = ("none", "hf-plain", "llama-none")  # each engine's baseline: speedup 1 by definition


def write_plots(out_dir: Path, summary: dict) -> list[str]:
    """Write the four PNGs into `out_dir`; return their file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots = {
        "speedup.png": _speedup,
        "accept_len.png": _accept_len,
        "acceptance_by_position.png": _by_position,
        "tokens_per_s.png": _tokens_per_s,
    }
    for name, draw in plots.items():
        fig, ax = plt.subplots(figsize=(max(9, 0.7 * len(summary)), 4.5))
        if not draw(ax, summary):
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        fig.tight_layout()
        fig.savefig(out_dir / name, dpi=110)
        plt.close(fig)
    return list(plots)


def categories(summary: dict) -> list[str]:
    """The summary's categories in workload order, then "all"."""
    return list(dict.fromkeys(c for per in summary.values() for c in per if c != ALL)) + [ALL]


def _style(summary: dict, m: str) -> dict:
    """One colour per method (the same in every plot); hatching marks the peers' engines."""
    import matplotlib.pyplot as plt

    i = list(summary).index(m)
    hatch = "//" if m.startswith("hf-") else ".." if m.startswith("llama-") else None
    return {"color": plt.get_cmap("tab20")(i % 20), "hatch": hatch, "edgecolor": "white", "linewidth": 0}


def _grouped_bars(ax, summary: dict, key: str, methods: list[str]) -> bool:
    cats = categories(summary)
    if not methods:
        return False
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        vals = [summary[m].get(c, {}).get(key) or 0.0 for c in cats]
        ax.bar(
            [x + (i - (len(methods) - 1) / 2) * width for x in range(len(cats))],
            vals,
            width,
            label=m,
            **_style(summary, m),
        )
    ax.set_xticks(range(len(cats)), cats, rotation=20, ha="right")
    ax.legend(fontsize=7, ncol=min(4, len(methods)))
    return True


def _speedup(ax, summary: dict) -> bool:
    methods = [m for m, per in summary.items() if m not in PLAIN and per[ALL]["speedup"] is not None]
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set(title="Speedup over the same engine's plain decoding, by category", ylabel="speedup (x)")
    return _grouped_bars(ax, summary, "speedup", methods)


def _accept_len(ax, summary: dict) -> bool:
    methods = [m for m, per in summary.items() if per[ALL]["mean_accept_len"] is not None and m not in PLAIN]
    ax.set(title="Mean acceptance length (tokens per target forward) by category", ylabel="tokens")
    return _grouped_bars(ax, summary, "mean_accept_len", methods)


def _by_position(ax, summary: dict) -> bool:
    curves = {
        m: per[ALL]["per_position_acceptance"] for m, per in summary.items() if per[ALL]["per_position_acceptance"]
    }
    for m, ys in curves.items():
        ax.plot(
            range(1, len(ys) + 1),
            ys,
            marker="o",
            ms=3,
            label=m,
            color=_style(summary, m)["color"],
            ls="--" if m.startswith("llama-") else "-",
        )
    ax.set(
        title="Acceptance by draft position (all prompts)",
        xlabel="draft position",
        ylabel="P(accepted)",
        ylim=(0, 1.05),
    )
    if curves:
        ax.legend(fontsize=8)
    return bool(curves)


def _tokens_per_s(ax, summary: dict) -> bool:
    methods = list(summary)
    s = [summary[m][ALL] for m in methods]
    mid = [e["tokens_per_s"] for e in s]
    err = [
        [max(0.0, v - e["tokens_per_s_min"]) for v, e in zip(mid, s)],
        [max(0.0, e["tokens_per_s_max"] - v) for v, e in zip(mid, s)],
    ]
    for i, m in enumerate(methods):
        ax.bar(i, mid[i], yerr=[[err[0][i]], [err[1][i]]], capsize=4, **_style(summary, m))
    ax.set_xticks(range(len(methods)), methods, rotation=20, ha="right")
    ax.set(title="Tokens/s per method (all prompts; bars: min-max over repeats)", ylabel="tokens/s")
    return bool(methods)
