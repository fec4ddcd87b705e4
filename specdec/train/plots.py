"""Learning curves of trained heads: validation mean acceptance length (tau) against training tokens, and the
per-step acceptance at the end, from their manifests (matplotlib, Agg)."""

from __future__ import annotations

import json
from pathlib import Path


def plot_heads(manifests: list[Path], out: Path) -> Path:
    """One PNG: left, tau against row tokens per head; right, P(steps 0..j accepted) of each head's last
    validation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curve, steps) = plt.subplots(1, 2, figsize=(11, 4))
    for path in manifests:
        m = json.loads(Path(path).read_text())
        data = m.get("data", {}).get("counts", {}).get("response_tokens")
        label = (
            f"{m['kind']} {m['target']} ("
            + (f"{data / 1e3:.0f}K response tokens, " if data else "")
            + f"{m['training']['hours']:.2f} h)"
        )
        tokens, tau = zip(*[(p[0], p[1]) for p in m["learning_curve"]])
        curve.plot([t / 1e3 for t in tokens], tau, marker="o", label=label)
        accept = m["validation"]["accept"]
        steps.plot(range(1, len(accept) + 1), accept, marker="o", label=label)
    curve.set(
        xlabel="training tokens (thousands)", ylabel="validation mean acceptance length (tau)", title="learning curve"
    )
    steps.set(
        xlabel="draft position", ylabel="P(positions 1..j accepted)", title="per-position acceptance", ylim=(0, 1)
    )
    for ax in (curve, steps):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


if __name__ == "__main__":
    import sys

    if len(sys.argv) < 3:
        sys.exit("usage: python -m specdec.train.plots OUT.png MANIFEST.json [MANIFEST.json ...]")
    print(plot_heads([Path(p) for p in sys.argv[2:]], Path(sys.argv[1])))
