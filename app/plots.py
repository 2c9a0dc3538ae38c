"""Plots written into the run directory."""

from __future__ import annotations

from pathlib import Path

import torch


def expert_load_heatmap(loads: torch.Tensor, path: Path, title: str) -> Path:
    """Paper Fig. 2 (a)-(b): fraction of each MoE layer's assignments per expert. loads: [layers, E]."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    frac = (loads / loads.sum(1, keepdim=True).clamp(min=1)).cpu().numpy()
    L, E = frac.shape
    fig, ax = plt.subplots(figsize=(max(7, min(16, 3 + E / 10)), 1.8 + 0.35 * L))
    im = ax.imshow(frac, aspect="auto", cmap="Blues", interpolation="nearest")
    ax.set_xlabel("expert id")
    ax.set_ylabel("MoE layer")
    ax.set_yticks(range(L), [str(i + 1) for i in range(L)])
    ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax, label="share of the layer's assignments")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
