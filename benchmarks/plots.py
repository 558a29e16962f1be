"""Figures for docs/benchmarks.md, drawn from the benchmarks' JSON results.

Each function returns the path it wrote, or ``None`` when matplotlib is not installed (it
is the optional extra ``bench``: ``pip install -e .[bench]``) or the results hold nothing
to draw. The benchmark scripts call these after writing their JSON, and ``run_all.py``
calls :func:`plot_all` so that ``--docs-only`` redraws every figure from the recorded
results.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

TIMELINE_PNG = "detection_timeline.png"
BALANCE_PNG = "sampler_balance.png"
_IMPL_LABELS = {"rd": "resilient_ddp", "torch": "plain torch (gloo)"}
_KIND_LABELS = {
    "kill": "rank 1 killed (SIGKILL)",
    "raise": "rank 1 raises",
    "hang": "rank 1 hangs (alive, stuck)",
    "divergence": "rank 1 diverges",
}
_warned = False


def _pyplot() -> Any:
    """matplotlib.pyplot with the Agg backend, or None (said once) without matplotlib."""
    global _warned
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        if not _warned:
            print("matplotlib is not installed (pip install -e .[bench]): no figures drawn")
            _warned = True
        return None
    return plt


def _save(fig: Any, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    # No timestamp or version in the file, so that an unchanged figure is an unchanged file.
    fig.savefig(path, dpi=110, metadata={"Software": None})
    return path


# -- detection timeline -------------------------------------------------------------------------
def _representative(runs: list[dict[str, Any]], kind: str, impl: str) -> dict[str, Any] | None:
    """The run of (kind, impl) whose last-raised time is the median; else the first run."""
    mine = [r for r in runs if r["kind"] == kind and r["impl"] == impl and r.get("ranks")]
    if not mine:
        return None
    complete = sorted((r for r in mine if r.get("all_raised")), key=lambda r: r["last_raised_s"])
    if len(complete) == len(mine):
        return complete[(len(complete) - 1) // 2]
    return next(r for r in mine if not r.get("all_raised"))


def plot_timeline(
    data: dict[str, Any],
    path: Path,
    kinds: tuple[str, ...] = ("kill", "raise", "hang", "divergence"),
) -> Path | None:
    """Per-rank training steps around the fault, and when each rank raised: one row per
    fault kind, resilient_ddp on the left and plain torch on the right."""
    plt = _pyplot()
    runs = data.get("runs", [])
    kinds = tuple(k for k in kinds if any(r["kind"] == k for r in runs))
    if plt is None or not kinds:
        return None
    setup = data.get("setup", {})
    window = float(setup.get("window_s", 15.0))
    timeout = float(setup.get("timeout_s", 10.0))
    culprit = int(setup.get("culprit", 1))
    fig, axes = plt.subplots(
        len(kinds), 2, figsize=(12, 1.9 * len(kinds) + 0.9), sharex=True, squeeze=False
    )
    for row, kind in enumerate(kinds):
        for col, impl in enumerate(("rd", "torch")):
            ax = axes[row][col]
            run = _representative(runs, kind, impl)
            if run is None:
                ax.set_axis_off()
                continue
            _draw_run(ax, run, culprit, window)
            ax.set_title(f"{_IMPL_LABELS[impl]}: {_KIND_LABELS.get(kind, kind)}", fontsize=10)
    for ax in axes[-1]:
        ax.set_xlabel("seconds from the fault")
    fig.suptitle(
        f"Training steps per rank (a box per completed step) and when each rank raised; "
        f"same timeout T = {timeout:g} s on both sides\n(time axis linear within 1 s of the "
        "fault, logarithmic beyond)",
        fontsize=10,
    )
    fig.tight_layout()
    out = _save(fig, path)
    plt.close(fig)
    return out


def _draw_run(ax: Any, run: dict[str, Any], culprit: int, window: float) -> None:
    ranks = sorted(run["ranks"], key=int)
    left = -1.0
    # Linear within a second of the fault (the steps, the fast detections), logarithmic
    # beyond (the timeouts), so that both show on one axis.
    ax.set_xscale("symlog", linthresh=1.0, linscale=0.7)
    ax.set_xlim(left, window + 1)
    ticks = [-1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 5.0, 10.0, window]
    ax.set_xticks(ticks)
    ax.set_xticklabels([f"{x:g}" for x in ticks])
    ax.set_ylim(len(ranks) - 0.4, -0.7)

    def late(t: float) -> bool:  # right of the middle: label it on the left
        x = ax.transAxes.inverted().transform(ax.transData.transform((t, 0.0)))[0]
        return bool(x > 0.6)

    for r in ranks:
        info = run["ranks"][r]
        y = int(r)
        steps = [s for s in info["steps_s"] if s >= left]
        gaps = [b - a for a, b in zip(info["steps_s"], info["steps_s"][1:], strict=False)]
        width = 0.8 * (statistics.median(gaps) if gaps else 0.05)
        ax.broken_barh(
            [(s - width, width) for s in steps],
            (y - 0.3, 0.6),
            facecolors="tab:blue" if int(r) != culprit else "tab:gray",
        )
        wrong = info.get("wrong_steps_s", [])
        if wrong:
            ax.broken_barh(
                [(s - width, width) for s in wrong], (y - 0.3, 0.6), facecolors="tab:red"
            )
            ax.annotate(
                "wrong sum, no error",
                (wrong[0], y),
                xytext=(4, -12),
                textcoords="offset points",
                fontsize=7.5,
                color="tab:red",
            )
        if "raised_s" in info:
            t = info["raised_s"]
            ax.plot(
                [t],
                [y],
                marker="D",
                color="tab:green" if info["names_culprit"] else "tab:orange",
                markersize=8,
                zorder=3,
            )
            named = f"names rank {culprit}" if info["names_culprit"] else "no rank named"
            ax.annotate(
                f"{info['type']} after {t:.2f} s ({named})",
                (t, y),
                xytext=(-6 if late(t) else 6, 7),
                textcoords="offset points",
                ha="right" if late(t) else "left",
                fontsize=7.5,
            )
        elif info.get("survivor"):
            last = steps[-1] if steps else 0.0
            ax.annotate(
                "",
                xy=(window, y),
                xytext=(max(last, 0.0), y),
                arrowprops={"arrowstyle": "->", "color": "tab:red", "lw": 1.2},
            )
            ax.annotate(
                f"still waiting, no error after {window:g} s",
                (window, y),
                xytext=(-4, 7),
                textcoords="offset points",
                ha="right",
                fontsize=7.5,
                color="tab:red",
            )
        elif int(r) == culprit:
            label = {"kill": "killed", "raise": "raised and exited", "hang": "stuck"}.get(
                run["kind"], "diverged"
            )
            ax.annotate(
                label,
                (0.0, y),
                xytext=(6, 7),
                textcoords="offset points",
                fontsize=7.5,
                color="tab:gray",
            )
    ax.axvline(0.0, color="tab:red", linestyle="--", linewidth=1)
    ax.set_yticks([int(r) for r in ranks])
    ax.set_yticklabels([f"rank {r}" + (" (culprit)" if int(r) == culprit else "") for r in ranks])
    ax.grid(axis="x", alpha=0.3)


# -- sampler balance ----------------------------------------------------------------------------
def plot_balance(data: dict[str, Any], path: Path) -> Path | None:
    """Largest rank cost over the lower bound against the world size, ours against torch's
    DistributedSampler: the plain split and the lockstep batches side by side."""
    plt = _pyplot()
    plain = data.get("plain", [])
    lockstep = data.get("lockstep", [])
    if plt is None or not plain:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=False)
    panels = [
        (axes[0], plain, "Plain split: largest rank total / LB", "BalancedDistributedSampler"),
        (
            axes[1],
            lockstep,
            "Lockstep, batch size "
            f"{data.get('setup', {}).get('batch_size', '?')}: sum of slowest batches / LB",
            "LockstepBatchSampler",
        ),
    ]
    for ax, rows, title, ours_name in panels:
        if not rows:
            ax.set_axis_off()
            continue
        ws = [r["world_size"] for r in rows]
        ours = [r["ours"] for r in rows]
        theirs = [r["torch"] for r in rows]
        ax.plot(ws, theirs, marker="s", color="tab:orange", label="torch DistributedSampler")
        ax.plot(ws, ours, marker="o", color="tab:blue", label=f"resilient_ddp {ours_name}")
        for w, a, b in zip(ws, ours, theirs, strict=True):
            ax.annotate(
                f"{b:.2f}",
                (w, b),
                xytext=(0, 6),
                textcoords="offset points",
                ha="center",
                fontsize=8,
                color="tab:orange",
            )
            ax.annotate(
                f"{a:.3f}",
                (w, a),
                xytext=(0, -13),
                textcoords="offset points",
                ha="center",
                fontsize=8,
                color="tab:blue",
            )
        ax.axhline(1.0, color="gray", linewidth=0.8, linestyle=":")
        ax.set_xscale("log", base=2)
        ax.set_xticks(ws)
        ax.set_xticklabels([str(w) for w in ws])
        ax.set_xlabel("ranks")
        ax.set_ylabel("ratio to the lower bound (1 = perfect)")
        top = max(theirs + ours)
        ax.set_ylim(1.0 - 0.1 * (top - 1.0) - 0.01, top + 0.12 * (top - 1.0) + 0.05)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    setup = data.get("setup", {})
    fig.suptitle(
        f"Load balance, {setup.get('items', '?'):,} items with lognormal costs "
        "(lower is better; LB = max(sum / ranks, largest item))",
        fontsize=10,
    )
    fig.tight_layout()
    out = _save(fig, path)
    plt.close(fig)
    return out


# -- all ----------------------------------------------------------------------------------------
def plot_all(results: Path, img_dir: Path) -> list[Path]:
    """Redraw every figure whose results exist in ``results``; return the files written."""
    written = []
    for name, fn, png in (
        ("detection", plot_timeline, TIMELINE_PNG),
        ("sampler", plot_balance, BALANCE_PNG),
    ):
        src = results / f"{name}.json"
        if not src.exists():
            continue
        try:
            data = json.loads(src.read_text(encoding="utf-8"))
        except ValueError:
            continue
        out = fn(data, img_dir / png)
        if out is not None:
            written.append(out)
    return written
