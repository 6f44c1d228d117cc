"""What the course's ipywidgets controls share: their look, a warning line, and a bar made of HTML.

Each module's controls live next to the arithmetic they drive (``scaling.ScalingConfigPicker``,
``raydata.DataSplitPicker``, ``faults.FaultToleranceControls``, ``planner_widgets.ZeroPicker`` and
``planner_widgets.MemoryPlanner``). They follow one pattern: the controls are plain ipywidgets, every change
calls ``_refresh`` in the kernel (which rewrites the summary and the warning), and the code after the
widget reads the current values from the object. Without a front end (papermill, the grader) nobody
moves the controls, so the values passed in are what the code gets.
"""
from __future__ import annotations

import html

STYLE = {"description_width": "190px"}
WIDTH = "500px"
COLOURS = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868", "train": "#4c72b0",
           "data": "#55a868", "idle": "#d9d9d9", "measured": "#8172b3", "host": "#c4ad66"}


def layout():
    import ipywidgets as w

    return w.Layout(width=WIDTH)


def warning(text: str | None) -> str:
    """The HTML of a refusal (empty when there is none)."""
    return "" if not text else f"<span style='color:#b00020'>&#9888; {html.escape(text)}</span>"


def stacked_bar(parts: list[tuple[str, float, str]], scale: float, width_px: int = 320, label: str = "") -> str:
    """One horizontal bar of ``(name, value, colour)`` parts, ``scale`` being the value of the full width."""
    cells = "".join(
        f"<span title='{html.escape(name)}' style='display:inline-block;height:14px;vertical-align:middle;"
        f"background:{colour};width:{max(0.0, value) / scale * width_px:.1f}px'></span>"
        for name, value, colour in parts if value > 0 and scale > 0)
    return f"<span style='display:inline-block;width:{width_px + 4}px'>{cells}</span> {label}"


def legend(names: dict[str, str]) -> str:
    """``{label: colour key}`` as coloured squares with their labels."""
    return " &nbsp; ".join(f"<span style='color:{COLOURS[key]}'>&#9632;</span> {label}" for label, key in names.items())


class Controls:
    """The base of the course's widgets: ``self.widget`` is shown, ``_refresh`` runs on every change."""

    widget = None

    def _watch(self, *controls) -> None:
        for control in controls:
            control.observe(self._refresh, names="value")

    def _refresh(self, _change=None) -> None:  # pragma: no cover - each widget has its own
        raise NotImplementedError

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)
