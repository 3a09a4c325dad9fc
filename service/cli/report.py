"""Human-readable plan summaries for the CLI: the JSON summary, text tables, a PNG of the rows.

No FastAPI here: this module only formats what the planner returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from treepack.proto.plan import Plan

__all__ = ["plan_summary", "format_table", "plans_table", "rows_table", "draw_rows", "PLOT_HINT"]

#: How to get the drawing's one dependency, from a clone (no package index serves treepack).
PLOT_HINT = "pip install matplotlib (the 'plot' extra)"


def plan_summary(plan: Plan) -> dict[str, Any]:
    """The JSON object ``treepack plan --json`` prints (planner figures only)."""
    st = plan.stats
    return {
        "placement": plan.placement,
        "strategy": plan.strategy,
        "packing": {"kind": plan.packing.kind, "min_shared_len": plan.packing.min_shared_len},
        "options": plan.options.to_wire(),
        "seq_len": plan.seq_len,
        "rows": plan.num_rows,
        "cp_size": plan.ranks.cp_size,
        "cp_attention": plan.ranks.cp_attention,
        "cp_shard_len": plan.ranks.shard_len,
        "row_tokens": plan.row_len.tolist(),
        "packed_tokens": st.packed_tokens,
        "unpacked_tokens": st.unpacked_tokens,
        "tree_tokens": st.tree_tokens,
        "lower_bound_rows": st.lower_bound_rows,
        "padding_tokens": st.padding_tokens,
        "saved_fraction": round(st.saved_fraction, 6),
        "sequences": st.sequences,
        "kept_sequences": st.kept_sequences,
        "overflow": [{"index": e.index, "length": e.length, "action": e.action} for e in plan.overflow],
        "timings_ms": {k: round(v, 3) for k, v in st.timings_ms.items()},
    }


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned text table (numbers right-aligned)."""
    cells = [[_fmt(x) for x in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    numeric = [all(_is_num(r[i]) for r in rows) if rows else False for i in range(len(headers))]

    def line(vals: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(vals, widths, numeric)).rstrip()

    out = [line(list(headers)), line(["-" * w for w in widths])]
    out += [line(r) for r in cells]
    return "\n".join(out)


def plans_table(items: Sequence[tuple[str, Plan]]) -> str:
    """One line per (batch name, plan): placement, rows, bound, tokens, saved %, phase times."""
    rows = []
    for name, p in items:
        st = p.stats
        rows.append(
            (
                name,
                p.placement if p.placement != "auto" else f"auto:{p.strategy}",
                st.rows,
                st.lower_bound_rows,
                st.packed_tokens,
                st.unpacked_tokens,
                st.tree_tokens,
                100.0 * st.saved_fraction,
                st.timings_ms["tree"],
                st.timings_ms["placement"],
                st.timings_ms["total"],
            )
        )
    return format_table(
        [
            "batch",
            "placement",
            "rows",
            "bound",
            "packed",
            "unpacked",
            "tree",
            "saved %",
            "tree ms",
            "place ms",
            "total ms",
        ],
        rows,
    )


def rows_table(plan: Plan) -> str:
    """One line per row of ``plan``: its tokens, fill and segment count."""
    seg = plan.segments
    return format_table(
        ["row", "tokens", "fill %", "segments"],
        [
            (r, int(plan.row_len[r]), 100.0 * plan.row_len[r] / plan.seq_len, int(seg.row_ptr[r + 1] - seg.row_ptr[r]))
            for r in range(plan.num_rows)
        ],
    )


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def _fmt(x: Any) -> str:
    if isinstance(x, (float, np.floating)):
        v = float(x)
        return f"{v:,.1f}" if abs(v) >= 100 else f"{v:.2f}" if abs(v) >= 1 else f"{v:.3f}"
    if isinstance(x, (int, np.integer)) and not isinstance(x, bool):
        return f"{int(x):,}"
    return str(x)


def draw_rows(
    plan: Plan, path: str, *, groups: Sequence[Any] | None = None, title: str = "", max_rows: int = 48
) -> None:
    """Draw the rows as horizontal bars: segments coloured by group, shared ones hatched.

    Args:
        plan: the plan to draw.
        path: PNG file to write.
        groups: per sequence its group label (colours); None colours by sequence.
        title: figure title.
        max_rows: draw at most this many rows (a note says how many were left out).

    Raises:
        ImportError: with an install hint if matplotlib is missing.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch, Rectangle
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError(f"drawing needs matplotlib: {PLOT_HINT}") from exc

    seg = plan.segments
    shown = min(plan.num_rows, max_rows)
    labels = list(groups) if groups is not None else list(range(plan.num_sequences))
    uniq = list(dict.fromkeys(labels))
    cmap = plt.get_cmap("tab20")
    colour = {g: cmap(i % 20) for i, g in enumerate(uniq)}
    fig, ax = plt.subplots(figsize=(12, 0.45 * shown + 1.6))
    C = plan.seq_len
    for r in range(shown):
        y = shown - 1 - r
        ax.add_patch(Rectangle((0, y + 0.1), C, 0.8, facecolor="#eeeeee", edgecolor="none"))
        for g in range(int(seg.row_ptr[r]), int(seg.row_ptr[r + 1])):
            shared = seg.sharers[g] >= 2
            ax.add_patch(
                Rectangle(
                    (int(seg.row_start[g]), y + 0.1),
                    int(seg.length[g]),
                    0.8,
                    facecolor=colour[labels[int(seg.seq[g])]],
                    edgecolor="black",
                    linewidth=0.3,
                    hatch="///" if shared else None,
                )
            )
    ax.set_xlim(0, C)
    ax.set_ylim(0, shown)
    ax.set_yticks([shown - 1 - r + 0.5 for r in range(shown)])
    ax.set_yticklabels([f"row {r}" for r in range(shown)])
    ax.set_xlabel("row position (tokens)")
    st = plan.stats
    note = (
        f"{plan.num_rows} rows ({st.lower_bound_rows} lower bound), "
        f"packed {st.packed_tokens:,} of {st.unpacked_tokens:,} tokens"
    )
    if shown < plan.num_rows:
        note += f"; first {shown} rows shown"
    ax.set_title(f"{title}\n{note}" if title else note, fontsize=10)
    handles = [
        Patch(facecolor="white", edgecolor="black", hatch="///", label="shared (>= 2 sequences)"),
        Patch(facecolor="#eeeeee", label="padding"),
    ]
    if len(uniq) <= 12:
        handles += [Patch(facecolor=colour[g], label=f"group {g}") for g in uniq]
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 6), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.4 / (0.45 * shown + 1.6), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
