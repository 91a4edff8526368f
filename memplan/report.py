"""What the CLI shows besides raw numbers: the GPU's usable memory, the dominant category at the peak, and
plots of live memory over a training step. Pure functions: data in, strings or figure files out; nothing
is printed. matplotlib is optional (`pip install 'memplan[plot]'`) and imported only to draw.
"""

from __future__ import annotations

import io
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from memplan.errors import BadInput
from memplan.estimate import Estimate, Timeline
from memplan.gpus import GpuSpec
from memplan.plan import check_output_path, write_atomically
from memplan.trace import ROLES
from memplan.units import format_bytes

# An assumption, not a measurement: the CUDA context (driver state, kernels' code) takes memory that
# torch's allocator never sees; a few hundred MiB to about 1 GiB depending on the card, driver and the
# libraries loaded. 500 MiB is typical of torch with cuBLAS on a recent driver.
CUDA_CONTEXT_BYTES = 500 * 2**20

PLOT_SUFFIXES = (".png", ".svg", ".html")
MATPLOTLIB_MISSING = "plots need matplotlib: pip install 'memplan[plot]'"

_COLOURS = {
    "weights": "#4c72b0",
    "inputs": "#8172b3",
    "optimizer_state": "#dd8452",
    "gradients": "#55a868",
    "activations": "#c44e52",
    "temporaries": "#937860",
}
_PHASE_SHADES = {"forward": "#e8f0fb", "backward": "#fbeaea", "optimizer": "#eef7ea"}
_NUMBERED = re.compile(r"^(.*?)(?:^|\.)\d+(?:\.|$)")


def usable_bytes(gpu: GpuSpec) -> int:
    """What a training step can use on `gpu`: its capacity less the assumed CUDA context."""
    return gpu.capacity_bytes - CUDA_CONTEXT_BYTES


def module_group(path: str) -> str:
    """Numbered siblings as one group, cut at the number: 'h.3.attn' -> 'h.*', 'layers.0' -> 'layers.*'."""
    match = _NUMBERED.match(path)
    if match is None:
        return path or "(top level)"
    return f"{match.group(1)}.*" if match.group(1) else "*"


@dataclass(frozen=True)
class Dominant:
    """The largest category at the peak and, when it is activations, the largest group of modules."""

    phase: str
    category: str
    share_pct: float  # of the peak
    module_group: str | None = None
    module_share_pct: float | None = None  # of the activation bytes at the peak
    module_share_is_lower_bound: bool = False  # the estimate named only some modules

    def describe(self) -> str:
        line = f"peak in {self.phase}: {self.category.replace('_', ' ')} {self.share_pct:.0f}%"
        if self.module_group is not None:
            at_least = "at least " if self.module_share_is_lower_bound else ""
            line += f", of which {self.module_group} {at_least}{self.module_share_pct:.0f}%"
        return line

    def to_json(self) -> dict:
        return {
            "phase": self.phase,
            "category": self.category,
            "share_pct": round(self.share_pct, 1),
            "module_group": self.module_group,
            "module_share_pct": None if self.module_share_pct is None else round(self.module_share_pct, 1),
            "module_share_is_lower_bound": self.module_share_is_lower_bound,
        }


def dominant(result: Estimate) -> Dominant:
    """The category holding most bytes at the peak; for activations, the modules holding most of them
    (from Estimate.top_modules, numbered siblings grouped)."""
    categories = result.breakdown.as_dict()
    category = max(categories, key=categories.__getitem__)
    share = 100 * categories[category] / result.peak_bytes if result.peak_bytes else 0.0
    activations = categories["activations"]
    if category != "activations" or not result.top_modules or not activations:
        return Dominant(result.peak_phase, category, share)
    groups: dict[str, int] = defaultdict(int)
    for path, nbytes in result.top_modules:
        groups[module_group(path)] += nbytes
    group = max(groups, key=groups.__getitem__)
    named = sum(nbytes for _, nbytes in result.top_modules)
    return Dominant(
        result.peak_phase, category, share, group, 100 * groups[group] / activations, named < activations
    )


@dataclass(frozen=True)
class Panel:
    """One timeline to draw: its title, the estimate's timeline and its peak."""

    title: str
    timeline: Timeline
    peak_bytes: int
    peak_event: int


def panel(title: str, result: Estimate) -> Panel:
    sim = result.simulation
    if sim is None or sim.timeline is None:
        raise ValueError("plotting needs an estimate made with with_timeline=True")
    return Panel(title, sim.timeline, sim.peak_bytes, sim.peak_event)


def check_plot_path(path: str | Path) -> Path:
    """Fail early (before any tracing) on a suffix we cannot write or a missing matplotlib."""
    path = Path(path)
    if path.suffix.lower() not in PLOT_SUFFIXES:
        raise BadInput(f"--plot {path}: the file must end in {', '.join(PLOT_SUFFIXES)}")
    check_output_path(path)  # a missing directory, a directory by that name
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise BadInput(MATPLOTLIB_MISSING) from None
    return path


def plot_timelines(
    path: str | Path,
    panels: Sequence[Panel],
    title: str,
    budget_bytes: int | None = None,
    gpu: GpuSpec | None = None,
) -> Path:
    """A stacked area chart of live bytes by category over the traced events, one panel per timeline
    (side by side, same y scale), with the phases shaded, the peak marked, and the budget and the GPU's
    capacity drawn as lines. Written atomically as PNG, SVG or HTML (the SVG in a page) by `path`'s suffix."""
    path = check_plot_path(path)
    # The object-oriented API with no pyplot: no global backend is chosen, nothing is shown.
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    top = max([p.peak_bytes for p in panels] + [budget_bytes or 0] + [gpu.capacity_bytes if gpu else 0])
    unit, scale = _unit(top)
    figure = Figure(figsize=(6.5 * len(panels), 5), layout="constrained")
    axes = figure.subplots(1, len(panels), sharey=True, squeeze=False)[0]
    for ax, item in zip(axes, panels):
        _draw_panel(ax, item, scale, budget_bytes, gpu)
    axes[0].set_ylabel(f"live memory ({unit})")
    axes[0].set_ylim(0, 1.08 * top / scale)
    handles = [Patch(color=_COLOURS[c], label=c.replace("_", " ")) for c in reversed(ROLES)]
    handles += [Patch(color=_PHASE_SHADES[p], label=f"{p} phase") for p in _PHASE_SHADES]
    figure.legend(handles=handles, loc="outside lower center", ncols=5, fontsize=8, frameon=False)
    figure.suptitle(title, fontsize=11)

    buffer = io.BytesIO()
    if path.suffix.lower() == ".png":
        figure.savefig(buffer, format="png", dpi=90)
    else:
        figure.savefig(buffer, format="svg")
    data = buffer.getvalue()
    if path.suffix.lower() == ".html":
        data = _html_page(title, data.decode())
    write_atomically(path, data)
    return path


def _draw_panel(ax, item: Panel, scale: float, budget_bytes: int | None, gpu: GpuSpec | None) -> None:
    live = item.timeline.live
    xs = range(len(live))
    # Library workspaces (cuBLAS) are temporaries in the tables too; keep the plot's categories the same.
    series = [
        [(point.get(c, 0) + (point.get("workspace", 0) if c == "temporaries" else 0)) / scale for point in live]
        for c in ROLES
    ]
    ax.stackplot(xs, *series, colors=[_COLOURS[c] for c in ROLES], linewidth=0)
    for phase, step, start, end in _phase_runs(item.timeline):
        if phase in _PHASE_SHADES:
            ax.axvspan(start - 0.5, end - 0.5, color=_PHASE_SHADES[phase], zorder=-1, linewidth=0)
    if 0 <= item.peak_event < len(live):
        ax.plot([item.peak_event], [item.peak_bytes / scale], marker="v", color="black", markersize=7)
        ax.annotate(
            f"peak {format_bytes(item.peak_bytes)}",
            (item.peak_event, item.peak_bytes / scale),
            textcoords="offset points",
            xytext=(0, 8),
            ha="center",
            fontsize=8,
        )
    if budget_bytes is not None:
        ax.axhline(budget_bytes / scale, color="black", linestyle="--", linewidth=1)
        ax.annotate(f"budget {format_bytes(budget_bytes)}", (0, budget_bytes / scale), xytext=(2, 2),
                    textcoords="offset points", fontsize=8, va="bottom")
    if gpu is not None:
        ax.axhline(gpu.capacity_bytes / scale, color="#b00020", linewidth=1.2)
        ax.annotate(f"{gpu.name} {format_bytes(gpu.capacity_bytes)}", (len(live) - 1, gpu.capacity_bytes / scale),
                    xytext=(-2, 2), textcoords="offset points", fontsize=8, va="bottom", ha="right", color="#b00020")
    ax.set_xlim(0, max(len(live) - 1, 1))
    ax.set_xlabel("event (allocation or free) in the traced steps")
    ax.set_title(item.title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)


def _phase_runs(timeline: Timeline) -> list[tuple[str, int, int, int]]:
    """(phase, step, first event, end) of each stretch of events in one phase of one step."""
    runs: list[tuple[str, int, int, int]] = []
    for index, (phase, step) in enumerate(timeline.phases):
        if runs and runs[-1][:2] == (phase, step):
            runs[-1] = (phase, step, runs[-1][2], index + 1)
        else:
            runs.append((phase, step, index, index + 1))
    return runs


def _unit(nbytes: int) -> tuple[str, float]:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return unit, float(size)
    return "bytes", 1.0


def _html_page(title: str, svg: str) -> bytes:
    # matplotlib's SVG starts with an XML prolog and a DOCTYPE, which do not belong inside HTML.
    svg = svg[svg.index("<svg"):]
    return (
        f'<!DOCTYPE html>\n<html lang="en">\n<head><meta charset="utf-8"><title>{_escape(title)}</title></head>\n'
        f"<body>\n{svg}\n</body>\n</html>\n"
    ).encode()


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


