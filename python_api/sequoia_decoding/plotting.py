"""Plots (matplotlib, imported when called): a speculation tree and a latency curve."""

from __future__ import annotations

import os

import numpy as np

from .tree import TreePlan

__all__ = ["plot_tree", "plot_latency", "plot_adaptive", "adaptive_series"]



def plot_tree(plan: TreePlan, path: str | os.PathLike, title: str | None = None) -> None:
    """Draw the tree to an image file (format from the extension, e.g. ``.png``).

    Root on top, one row per level; leaves spread left to right in depth-first order;
    nodes coloured by their acceptance probability, labelled with their rank when the
    tree is small. Uses matplotlib's Agg canvas directly (no pyplot, no GUI)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.collections import LineCollection
    from matplotlib.figure import Figure

    n = plan.num_nodes
    kids: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        kids[plan.parents[i]].append(i)
    x = [0.0] * n
    next_leaf = 0
    order: list[int] = []  # post-order
    stack = [(0, False)]
    while stack:
        node, done = stack.pop()
        if done or not kids[node]:
            if kids[node]:
                x[node] = (x[kids[node][0]] + x[kids[node][-1]]) / 2
            else:
                x[node] = float(next_leaf)
                next_leaf += 1
            order.append(node)
            continue
        stack.append((node, True))
        stack.extend((c, False) for c in reversed(kids[node]))
    y = [-float(dep) for dep in plan.depth]
    values = np.asarray(plan.node_values())
    leaves = max(1, next_leaf)
    width = min(40.0, max(6.5, 0.25 * leaves + 2.5))
    height = min(20.0, max(2.5, 0.9 * plan.num_levels + 1.2))
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    segs = [((x[plan.parents[i]], y[plan.parents[i]]), (x[i], y[i])) for i in range(1, n)]
    if segs:
        ax.add_collection(LineCollection(segs, colors="0.6", linewidths=0.6, zorder=1))
    size = max(8.0, min(160.0, 4000.0 / n))
    sc = ax.scatter(x, y, c=np.log10(np.maximum(values, 1e-12)), cmap="viridis", s=size,
                    vmin=min(-3.0, float(np.log10(max(values.min(), 1e-12)))), vmax=0.0,
                    zorder=2, edgecolors="k", linewidths=0.3)
    if n <= 64:
        for i in range(1, n):
            ax.annotate(str(plan.rank[i]), (x[i], y[i]), textcoords="offset points", xytext=(0, 6),
                        ha="center", fontsize=7)
    fig.colorbar(sc, ax=ax, label="log10 P(node accepted)")
    ax.set_yticks([-l for l in range(plan.num_levels)])
    ax.set_yticklabels([str(l) for l in range(plan.num_levels)])
    ax.set_ylabel("depth")
    ax.set_xticks([])
    ax.set_xlim(-1, leaves)
    ax.set_ylim(-(plan.num_levels - 1) - 0.5, 0.6)
    ax.set_title(title or f"Sequoia tree: {n} nodes, {plan.num_levels} levels\n"
                          f"E = {plan.expected_tokens:.3f} tokens/step", fontsize=10)
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=110)


def plot_latency(result: dict, path: str) -> None:
    """T(n) / T(1) against n (log-log), the knee marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = sorted(int(n) for n in result["target_latency_s"])
    t1 = result["target_latency_s"]["1"]
    ys = [result["target_latency_s"][str(n)] / t1 for n in ns]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(ns, ys, "o-", label="target forward, n tree tokens")
    ax.axvline(result["knee"], color="gray", ls="--", label=f"knee (<= {result['knee_ratio']}x one token)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tree tokens n")
    ax.set_ylabel("T(n) / T(1)")
    ax.set_title(f"{result['device']}, prefix {result['prefix']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def adaptive_series(history, steps: int | None = None) -> list[tuple[int, int, int]]:
    """``ReplanStats.history`` with a last point at ``steps`` (the request's step count), so that
    the step plot runs to the request's end."""
    history = list(history)
    if history and steps is not None and steps > history[-1][0]:
        history.append((steps, *history[-1][1:]))
    return history


def adaptive_ticks(history) -> list[int]:
    """The y ticks of :func:`plot_adaptive`: every node and level count the series takes."""
    return sorted({int(v) for h in history for v in h[1:3]})


def plot_adaptive(history, path: str | os.PathLike, title: str | None = None, steps: int | None = None) -> None:
    """The tree's nodes and levels over a request's steps, from ``ReplanStats.history``
    ([(step, nodes, levels)] at each change, the first plan at step 0), drawn to ``steps`` (the
    request's step count; a request without changes is then a flat line, not one point)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    history = adaptive_series(history, steps)
    if history:
        steps = [h[0] for h in history]
        ax.step(steps, [h[1] for h in history], where="post", label="tree nodes n")
        ax.step(steps, [h[2] for h in history], where="post", label="levels d")
    ax.set_xlabel("decoding step")
    ax.set_yscale("log", base=2)
    if history:  # every value drawn labelled as the integer it is (a log axis labels only powers of 2)
        values = adaptive_ticks(history)
        ax.set_yticks(values, [str(v) for v in values])
        ax.minorticks_off()
    ax.set_title(title or "adaptive trees")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
