"""`attn plot`: a run's curves from metrics.jsonl, and attention maps as heatmaps.

matplotlib is an optional extra (`pip install 'attn[plot]'`); nothing else imports this module.
Figures are written atomically, in the format the output's suffix names (png, pdf, svg).
"""

from __future__ import annotations

import math
from pathlib import Path

from .errors import AttnError
from .files import atomic_path
from .files import read_metrics as read_metrics_rows
from .formats import METRICS_FILE

X_AXES = ("step", "time", "both")


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise AttnError("attn plot needs matplotlib: pip install 'attn[plot]'") from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def _save(figure, output: str | Path) -> None:
    output = Path(output)
    kind = output.suffix.lstrip(".").lower() or "png"
    with atomic_path(output) as temp:
        figure.savefig(temp, format=kind, dpi=120, bbox_inches="tight")


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        raise AttnError(f"{run_dir} has no {METRICS_FILE}: not an attn run directory")
    rows, _ = read_metrics_rows(path)  # a torn last line (a run killed mid-append) left out
    if not rows:
        raise AttnError(f"{path} is empty: nothing to plot yet")
    return rows


# (panel title, [(field, label, line style)], log scale); a panel with no data is left out.
PANELS = [
    ("loss (label-smoothed)", [("loss", "train", "-"), ("valid_loss", "valid", "--")], False),
    ("perplexity", [("train_ppl", "train", "-"), ("valid_ppl", "valid", "--")], True),
    ("validation BLEU", [("valid_bleu", "valid", "-o")], False),
    ("validation chrF", [("valid_chrf", "valid", "-o")], False),
    ("validation F1", [("valid_f1", "valid", "-o")], False),
    ("learning rate", [("lr", "", "-")], False),
    ("target tokens/s", [("tokens_per_s", "", "-")], False),
]


def plot_runs(run_dirs: list[str], output: str | Path, x_axis: str = "both") -> list[str]:
    """Curves of one or more runs, overlaid (a colour per run): loss, perplexity, validation
    metric, learning rate and tokens/s, against steps and/or wall time (validation included).
    Returns the panel titles drawn."""
    if x_axis not in X_AXES:
        raise AttnError(f"--x {x_axis}: one of {', '.join(X_AXES)}")
    plt = _pyplot()
    runs = []
    for run_dir in run_dirs:
        rows = read_metrics(run_dir)
        for row in rows:
            if "nll" in row:
                row["train_ppl"] = math.exp(min(row["nll"], 700))
        runs.append((Path(run_dir).resolve().name, rows))
    panels = [panel for panel in PANELS
              if any(field in row for _, rows in runs for row in rows for field, _, _ in panel[1])]
    axes_x = {"step": ["step"], "time": ["time"], "both": ["step", "time"]}[x_axis]
    hours = max((row.get("elapsed_s", 0) for _, rows in runs for row in rows), default=0) > 7200
    figure, grid = plt.subplots(len(panels), len(axes_x), squeeze=False,
                                figsize=(6.5 * len(axes_x), 2.6 * len(panels)))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row_index, (title, series, log_scale) in enumerate(panels):
        for column, axis_name in enumerate(axes_x):
            axes = grid[row_index][column]
            for run_index, (name, rows) in enumerate(runs):
                for field, label, style in series:
                    points = [(_x(row, axis_name, hours), row[field]) for row in rows
                              if field in row and _x(row, axis_name, hours) is not None]
                    if points:
                        xs, ys = zip(*points)
                        legend = " ".join(part for part in (name if len(runs) > 1 else "",
                                                            label) if part)
                        axes.plot(xs, ys, style, color=colours[run_index % len(colours)],
                                  label=legend or None, markersize=3, linewidth=1.2)
            axes.set_title(title, fontsize=10)
            if log_scale:
                axes.set_yscale("log")
            axes.grid(alpha=0.3)
            axes.set_xlabel("step" if axis_name == "step" else
                            f"wall time ({'h' if hours else 'min'})")
            if axes.get_legend_handles_labels()[1]:
                axes.legend(fontsize=8)
    figure.tight_layout()
    _save(figure, output)
    plt.close(figure)
    return [panel[0] for panel in panels]


def _x(row: dict, axis_name: str, hours: bool):
    if axis_name == "step":
        return row.get("step")
    seconds = row.get("elapsed_s")
    return None if seconds is None else seconds / (3600 if hours else 60)


def plot_attention(path: str | Path, line: int, output: str | Path, kind: str = "encoder",
                   layer: int | None = None, head: int | None = None) -> tuple[int, list[int]]:
    """Heatmaps of one line's attention (`attn decode --attention`), the pieces as axis labels:
    every head of a layer side by side, as the paper's Figure 3 (or one head). `layer` and
    `head` count from 1; the default layer is the last. Returns (layer, heads drawn)."""
    from .attention_maps import read_attention

    plt = _pyplot()
    maps, pieces = read_attention(path, line)
    weights = maps[kind]  # (layers, heads, rows, columns)
    layers, heads = weights.shape[:2]
    layer = layers if layer is None else layer
    if not 1 <= layer <= layers:
        raise AttnError(f"--layer {layer}: the model has layers 1-{layers}")
    if head is not None and not 1 <= head <= heads:
        raise AttnError(f"--head {head}: the model has heads 1-{heads}")
    chosen = [head] if head is not None else list(range(1, heads + 1))
    source, out = pieces["source"], pieces["output"]
    rows, columns = {"encoder": (source, source), "decoder": (out, ["<s>"] + out[:-1]),
                     "cross": (out, source)}[kind]
    size = max(3.0, 0.22 * max(len(rows), len(columns)))
    figure, grid = plt.subplots(1, len(chosen), squeeze=False,
                                figsize=(size * len(chosen), size))
    for axes, number in zip(grid[0], chosen):
        axes.imshow(weights[layer - 1, number - 1].numpy(), cmap="Blues", vmin=0.0,
                    vmax=1.0, aspect="equal")
        axes.set_xticks(range(len(columns)), columns, rotation=90, fontsize=7)
        axes.set_yticks(range(len(rows)), rows if number == chosen[0] else [""] * len(rows),
                        fontsize=7)
        axes.set_title(f"head {number}", fontsize=9)
    names = {"encoder": "encoder self-attention", "decoder": "decoder self-attention",
             "cross": "encoder-decoder attention"}
    figure.suptitle(f"line {line}: {names[kind]}, layer {layer} of {layers}", fontsize=10)
    figure.tight_layout()
    _save(figure, output)
    plt.close(figure)
    return layer, chosen
