"""Writing a result: its JSON under runs/, its PNG beside it, its table on stdout.

Owns: the one JSON writer, matplotlib behind `pyplot()` (the `bench` extra), and the
`--replot` / `--table` path that redraws from a committed JSON.
Invariants: a result's JSON is written before anything is drawn, so a box without
matplotlib still keeps the measurement; only the PNG is skipped, with a message that
names the extra to install.
Errors: `pyplot()` raises PlotUnavailable when matplotlib is not installed.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ._facts import Json

INSTALL_HINT = "install the bench extra: .venv/bin/pip install -e '.[bench]'"

Plot = Callable[[Json, Path], None]
Table = Callable[[Json], str]


class PlotUnavailable(Exception):
    """matplotlib is not installed, so a benchmark cannot draw its PNG."""


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise PlotUnavailable(f"matplotlib is not installed; {INSTALL_HINT}") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: Path) -> None:
    """Lay out, write (110 dpi) and close a matplotlib figure."""
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    pyplot().close(fig)


def draw(plot: Plot, document: Json, path: Path) -> bool:
    """Draw `document` to `path`; False, after saying why on stderr, when it cannot."""
    try:
        plot(document, path)
    except PlotUnavailable as exc:
        print(f"no plot {path.name}: {exc}", file=sys.stderr, flush=True)
        return False
    return True


def write_json(path: Path, document: Mapping[str, Json], *, indent: int = 2) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=indent) + "\n")


def publish(
    path: Path,
    document: Mapping[str, Json],
    *,
    plot: Plot | None = None,
    table: Table | None = None,
    indent: int = 2,
) -> None:
    """Write a result, draw its PNG beside it, print its README table."""
    write_json(path, document, indent=indent)
    written = [str(path)]
    png = path.with_suffix(".png")
    if plot is not None and draw(plot, document, png):
        written.append(str(png))
    if table is not None:
        print(table(document))
    print(f"wrote {' and '.join(written)}", flush=True)


def show(path: Path, *, replot: Plot | None = None, table: Table | None = None) -> int:
    """A benchmark's `--replot` / `--table`: redraw the PNG beside the JSON at `path`
    and/or print its table, without measuring anything."""
    document = json.loads(path.read_text())
    code = 0
    if replot is not None:
        png = path.with_suffix(".png")
        if draw(replot, document, png):
            print(f"wrote {png}", flush=True)
        else:
            code = 1
    if table is not None:
        print(table(document))
    return code
