"""A partial frame renders the widgets it shows, not every widget on the screen.

Textual's compositor (8.2.8, pinned in pyproject.toml) makes a partial frame from the
widgets whose *clip* overlaps the frame's region (`Compositor._get_renders`). A widget's clip
is the visible region of its container, so every widget of the screen's top level (the
header, the footer, the perf panel, the prompt, the message list and each message in it) is
rendered, from its line cache at best, for every frame, even one that repaints one line of
the reply; then its lines outside the region are dropped. Measured on this repository's
chat screen (benchmarks/lab/gpu_paced_replay.py, a 2-core CPU): the first text's frame, one
line of the reply, called render_lines on 11-13 widgets and took 2.3-3.9 ms. Here a widget
takes part when its visible part (its region within its clip) overlaps the frame's region:
only those give the frame a cell, and the screen itself (the background) covers all of it,
so the frame is the same (tests/test_app.py checks the terminal's content
after streamed frames against a full render). Full frames (no region) are unchanged.
"""

from __future__ import annotations

from textual._compositor import Compositor
from textual.geometry import Region

_textual_get_renders = Compositor._get_renders


def _get_renders(self, crop: Region | None = None):
    if not crop:
        yield from _textual_get_renders(self, crop)
        return
    # Textual's own loop, with the widget's visible region (not its clip) tested against crop
    overlaps = crop.overlaps
    intersection = Region.intersection
    for widget, (region, clip) in list(self.visible_widgets.items()):
        if not overlaps(clip):
            continue
        if Region.contains_region(clip, region):
            if overlaps(region):
                yield region, clip, widget.render_lines(Region(0, 0, region.width,
                                                               region.height))
            continue
        x, y, width, height = intersection(region, clip)
        if width and height and overlaps(Region(x, y, width, height)):
            yield region, clip, widget.render_lines(Region(x - region.x, y - region.y,
                                                           width, height))


def install() -> None:
    """Make partial frames this way in this process (NanoqwenApp, while it runs)."""
    Compositor._get_renders = _get_renders


def uninstall() -> None:
    """Textual's own way again."""
    Compositor._get_renders = _textual_get_renders
