"""Plots of results: :func:`plot_sweep`, a sweep's recall against λ (``pefa-gpu sweep``)."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Sequence

from .errors import MissingDependencyError

SOFTWARE = "pefa_gpu sweep plot"  # the PNG's Software field: a file plot_sweep wrote


def plot_sweep(rows: Sequence[dict], path: str | Path, title: str = "",
               metrics: Sequence[str] = ("recall@10", "recall@100")) -> Path:
    """Recall vs λ, one line per method and k, ERM dashed; one panel per metric. Writes a PNG."""
    try:
        from matplotlib.figure import Figure  # no pyplot: no global backend or figure list
    except ImportError as exc:
        raise MissingDependencyError("plots need matplotlib: pip install matplotlib") from exc
    fig = Figure(figsize=(5.5 * len(metrics), 4))
    axes = fig.subplots(1, len(metrics), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        groups: dict[str, list[dict]] = {}
        for r in rows:
            if r["method"] == "erm":
                ax.axhline(r[metric], color="black", linestyle="--", label="ERM")
            elif r["lam"] is None:  # NUDGE-M / -N, adapter, prf: no λ
                ax.axhline(r[metric], linestyle=":", color="C9" if r["method"] == "nudge-n"
                           else "C8", label=r["method"].upper())
            else:
                groups.setdefault({"xs": "PEFA-XS", "adapter+xs": "ADAPTER+XS"}.get(
                    r["method"], f"PEFA-XL k={r['k']}"), []).append(r)
        for label, rs in groups.items():
            rs = sorted(rs, key=lambda r: r["lam"])
            ax.plot([r["lam"] for r in rs], [r[metric] for r in rs], marker="o", label=label)
        ax.set_xlabel("λ (weight of the ERM score)")
        ax.set_ylabel(metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    from .storage import write_output_file
    tag = {"Software": SOFTWARE} if Path(path).suffix.lower() == ".png" else None
    return write_output_file(path, lambda tmp: fig.savefig(tmp, dpi=110, metadata=tag), "plot")


def is_sweep_plot(path: str | Path) -> bool:
    """Whether ``path`` is a regular file (a link is not) that :func:`plot_sweep` wrote."""
    try:
        flags = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        fd = os.open(path, os.O_RDONLY | flags)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as f:  # the field comes first, at byte 50
        return stat.S_ISREG(os.fstat(fd).st_mode) and SOFTWARE.encode() in f.read(256)
