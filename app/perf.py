"""The perf panel: the engine's own figures for the current reply, always on screen.

Everything shown comes from the bridge's `StatsUpdate` events, i.e. from the backend's
timing of each step (GPU events on CUDA, perf_counter around forward+sample on the
reference backend), never from UI timers: the UI only learns the figures in batches, so a
UI-side clock would measure batching, not decoding.

`freeze_timing` (a test-only switch, `NanoqwenApp(freeze_perf=True)` or the
NANOQWEN_FREEZE_PERF=1 environment variable) replaces the figures that vary from run to run
(ms/token, TTFT, tok/s and its sparkline) with a fixed "frozen" marker, so SVG snapshots
are deterministic. Token counts, backend, model and mode stay real.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Label, Sparkline, Static

from .bridge import StatsUpdate

# Keep the sparkline bounded on long replies; Sparkline buckets to its width anyway.
_MAX_POINTS = 2048


@dataclass
class ModelInfo:
    backend: str            # "cuda" | "reference"
    device: str             # "NVIDIA H200", "cpu"
    model: str              # model name from the file's config
    modes: tuple[str, ...]  # modes the backend supports
    mode: str               # mode it runs now
    max_context: int
    fallback: str | None    # why "auto" did not pick CUDA, if it did not


class PerfPanel(Vertical):
    """Right-hand panel. Call `set_model`, `start_reply`, `record` and `set_mode`."""

    def __init__(self, freeze_timing: bool = False, **kw) -> None:
        super().__init__(**kw)
        self.freeze_timing = freeze_timing
        self.info: ModelInfo | None = None
        self.steps_ms: list[float] = []     # decode step times of the current reply
        self.last: StatsUpdate | None = None
        self.kv_len = 0

    def compose(self) -> ComposeResult:
        yield Label("Performance", classes="perf-title")
        yield Static("", id="perf-backend")
        yield Static("", id="perf-model")
        yield Static("", id="perf-mode")
        yield Static("", id="perf-decode")
        yield Static("", id="perf-median")
        yield Static("", id="perf-ttft")
        yield Label("tok/s over the reply", classes="perf-caption")
        yield Sparkline([], id="perf-spark")
        yield Static("", id="perf-context")

    def on_mount(self) -> None:
        self._refresh()

    # --- inputs ---------------------------------------------------------------------
    def set_model(self, info: ModelInfo | None) -> None:
        self.info = info
        self.steps_ms = []
        self.last = None
        self.kv_len = 0
        self._refresh()

    def set_mode(self, mode: str) -> None:
        if self.info is not None:
            self.info.mode = mode
        self._refresh()

    def set_context(self, kv_len: int) -> None:
        self.kv_len = kv_len
        self._refresh()

    def start_reply(self) -> None:
        self.steps_ms = []
        self.last = None
        self._refresh()

    def record(self, s: StatsUpdate) -> None:
        self.steps_ms.extend(s.step_ms)
        del self.steps_ms[:-_MAX_POINTS]
        self.last = s
        self.kv_len = s.kv_len
        if self.info is not None:
            self.info.mode = s.mode
            self.info.max_context = s.max_context
        self._refresh()

    # --- figures (also read by tests) -------------------------------------------------
    @property
    def live_ms(self) -> float | None:
        return self.last.ms_per_token if self.last else None

    @property
    def median_ms(self) -> float | None:
        return statistics.median(self.steps_ms) if self.steps_ms else None

    @property
    def ttft_ms(self) -> float | None:
        return self.last.ttft_ms if self.last else None

    # --- rendering --------------------------------------------------------------------
    def _fmt(self, v: float | None, unit: str) -> str:
        if v is None:
            return "—"
        if self.freeze_timing:
            return f"(frozen) {unit}"
        return f"{v:.2f} {unit}" if v < 100 else f"{v:.0f} {unit}"

    def _refresh(self) -> None:
        if not self.is_mounted:
            return
        info = self.info
        q = self.query_one
        if info is None:
            q("#perf-backend", Static).update("backend   [dim]no model loaded[/]")
            q("#perf-model", Static).update("model     —")
            q("#perf-mode", Static).update("mode      —")
        else:
            backend = f"backend   [b]{info.backend}[/] ({info.device})"
            if info.fallback:
                backend += f"\n[dim]{info.fallback}[/]"
            q("#perf-backend", Static).update(backend)
            q("#perf-model", Static).update(f"model     {info.model}")
            if len(info.modes) == 1:
                # Say plainly that the toggle has nothing to switch to here.
                mode = f"mode      [b]{info.mode}[/] [dim](only mode here)[/]"
            else:
                other = [m for m in info.modes if m != info.mode]
                mode = f"mode      [b]{info.mode}[/] [dim](ctrl+g: {'/'.join(other)})[/]"
            q("#perf-mode", Static).update(mode)
        tag = f" [dim]({self.last.mode})[/]" if self.last else ""
        q("#perf-decode", Static).update(f"decode    {self._fmt(self.live_ms, 'ms/tok')}{tag}")
        q("#perf-median", Static).update(f"median    {self._fmt(self.median_ms, 'ms/tok')}")
        q("#perf-ttft", Static).update(f"TTFT      {self._fmt(self.ttft_ms, 'ms')}")
        spark = q("#perf-spark", Sparkline)
        spark.data = [] if self.freeze_timing else [1000.0 / max(m, 1e-3) for m in self.steps_ms]
        max_ctx = info.max_context if info else 0
        pct = f" ({100 * self.kv_len / max_ctx:.0f}%)" if max_ctx else ""
        q("#perf-context", Static).update(f"context   {self.kv_len} / {max_ctx}{pct}")
