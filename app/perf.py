"""The perf panel: what the engine does and what reaches the person, for the current reply.

Two kinds of figures, side by side:
  * the engine's own, from the service's `StatsUpdate`s (the backend's timing of each step:
    GPU events on CUDA, perf_counter around forward+sample on the reference backend): the
    decode rate over the last second of steps (rolling, not the last token), its median
    ms/token over the same steps, TTFT (prefill + first sample) and the prompt's tokens/s
    (known when the reply ends: the session reports the prefill split in its final Stats);
  * what the person sees, measured in the UI: the chat screen passes the wall-clock time at
    which each Batch was written to the Markdown stream (`record(stats, shown_at=t)`), and the
    time the message was sent (`start_reply(t0)`, Enter); from those come the TTFT they saw
    and the rate at which tokens reached the screen after the first text (engine SeenMeter).

`freeze_timing` (a test-only switch, `NanoqwenApp(freeze_perf=True)` or the
NANOQWEN_FREEZE_PERF=1 environment variable) replaces every figure that varies from run to
run (rates, ms, TTFTs, the sparkline) with a fixed "(frozen)" marker, all of them as soon as a
reply has reported anything (whether a figure exists yet can depend on timing too), so SVG
snapshots are deterministic. Token counts, backend, model and mode stay real.

Work per update is bounded (the service keeps the rolling window; the sparkline keeps at most
_MAX_POINTS points), so a long reply does not make the panel slower. While a reply streams the
rows are redrawn at most every REDRAW_INTERVAL (the service reports every ~40 ms; nobody reads
a figure that changes 25 times a second), every REDRAW_INTERVAL_CPU when the engine runs on the
CPU (each redraw is a frame made on the engine's cores), and a row whose text did not change is
not touched.
A changed row that keeps its shape (same lines, each fitting the panel) is redrawn without a
layout pass: `Static.update` otherwise reflows the whole screen, every message of the chat
with it, and measured on the 2-core CPU (bundled model, headless app) the panel's 25 layouts a
second were most of the UI thread's work, which it took from the engine's cores.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.content import Content
from textual.widgets import Label, Sparkline, Static

from nanoqwen.engine.service import SeenMeter, StatsUpdate, tokens_per_s

from .settings import SPECULATION_NAMES

# Keep the sparkline bounded on long replies; Sparkline buckets to its width anyway.
_MAX_POINTS = 2048
_INDENT = " " * 10   # continuation lines line up under the values ("decode    ")
REDRAW_INTERVAL = 0.2  # seconds: the least time between two redraws while a reply streams
# ... with the engine on the CPU: a redraw's frame (4-7 ms of UI-thread CPU on the 2-core CI
# machine) delays the engine by about as much (widgets.CPU_ENGINE_UI_SHARE says why); at 0.2 s
# the panel made 13-21 of a 256-token turn's ~45 frames there (benchmarks/RESULTS.md, session 14)
REDRAW_INTERVAL_CPU = 1.0


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

    # A long fallback reason in a short terminal scrolls the panel rather than hiding rows.
    # Folded (`fold`, class -line; its style is in chat.tcss) it is one line: the summary.
    DEFAULT_CSS = """
    PerfPanel { overflow-y: auto; }
    """

    def __init__(self, freeze_timing: bool = False, **kw) -> None:
        super().__init__(**kw)
        self.freeze_timing = freeze_timing
        self.info: ModelInfo | None = None
        self.steps_ms: list[float] = []     # decode step times of the current reply
        self._rates: list[float] = []       # the same as tok/s, for the sparkline
        self.last: StatsUpdate | None = None
        self.seen = SeenMeter()
        self.kv_len = 0
        self._shown: dict[str, str] = {}    # row id -> the markup it shows
        self._drawn_at = -1e9               # time.monotonic() of the latest redraw
        self._redraw_timer = None           # a pending throttled redraw
        self._held = False                  # no redraw until release() (hold)
        self._pending = False               # a redraw was asked for while held

    def compose(self) -> ComposeResult:
        yield Static("", id="perf-line")
        yield Label("Performance", classes="perf-title")
        yield Static("", id="perf-backend")
        yield Static("", id="perf-model")
        yield Static("", id="perf-mode")
        yield Static("", id="perf-decode")
        yield Static("", id="perf-screen")
        yield Static("", id="perf-ttft")
        yield Static("", id="perf-prompt")
        yield Label("tok/s over the reply", classes="perf-caption")
        yield Sparkline([], id="perf-spark")
        yield Static("", id="perf-context")

    def on_mount(self) -> None:
        self._refresh()

    @property
    def redraw_interval(self) -> float:
        """The least time between two redraws while a reply streams (module doc)."""
        on_cpu = self.info is not None and self.info.device == "cpu"
        return REDRAW_INTERVAL_CPU if on_cpu else REDRAW_INTERVAL

    # --- inputs ---------------------------------------------------------------------
    def set_model(self, info: ModelInfo | None) -> None:
        self.info = info
        self.kv_len = 0
        self.start_reply()

    def set_mode(self, mode: str) -> None:
        if self.info is not None:
            self.info.mode = mode
        self._refresh()

    def fold(self, line: bool) -> None:
        """One line (the summary) or the whole panel."""
        if line != self.has_class("-line"):
            self.set_class(line, "-line")
            self._refresh()

    def set_context(self, kv_len: int) -> None:
        self.kv_len = kv_len
        self._refresh()

    def hold(self) -> None:
        """Draw nothing until `release()`; what was asked for meanwhile is drawn then. The
        chat holds the panel until its first text frame: a panel redraw in that frame would
        widen the screen region the frame renders from the message column to the screen."""
        self._held = True

    def release(self) -> None:
        self._held = False
        if self._pending:
            self._pending = False
            self._refresh()

    def start_reply(self, t0: float | None = None) -> None:
        """A new reply was asked for at `t0` (the UI clock; now if None)."""
        self.steps_ms = []
        self._rates = []
        self.last = None
        self.seen.start(t0)
        self._refresh()

    def record(self, s: StatsUpdate, shown_at: float | None = None) -> None:
        """The engine's figures so far; `shown_at`: when the text that came with them was
        written to the screen (None: no text came with them)."""
        self.steps_ms.extend(s.step_ms)
        self._rates.extend(tokens_per_s(1, max(m, 1e-3)) for m in s.step_ms)
        if len(self.steps_ms) > _MAX_POINTS:
            del self.steps_ms[:-_MAX_POINTS]
            del self._rates[:-_MAX_POINTS]
        if shown_at is not None:
            self.seen.wrote(s.n_generated, shown_at)
        self.last = s
        self.kv_len = s.kv_len
        if self.info is not None:
            self.info.mode = s.mode
            self.info.max_context = s.max_context
        # The first text and the final figures are drawn at once; the rest at most every
        # redraw_interval (a timer draws the latest figures once the interval is up).
        wait = self._drawn_at + self.redraw_interval - time.monotonic()
        if s.final or (shown_at is not None and self.seen.first == self.seen.last) or wait <= 0:
            self._refresh()
        elif self._redraw_timer is None:
            self._redraw_timer = self.set_timer(wait, self._refresh)

    # --- figures (also read by tests) -------------------------------------------------
    @property
    def live_ms(self) -> float | None:
        """The latest decode step."""
        return self.last.ms_per_token if self.last else None

    @property
    def median_ms(self) -> float | None:
        """Median decode step of the whole reply (once it has ended)."""
        return self.last.median_ms if self.last else None

    @property
    def decode_tokens_per_s(self) -> float | None:
        """The engine's decode rate over the last second of steps."""
        return self.last.rolling_tokens_per_s if self.last else None

    @property
    def decode_median_ms(self) -> float | None:
        return self.last.rolling_median_ms if self.last else None

    @property
    def ttft_ms(self) -> float | None:
        """TTFT as the engine measured it."""
        return self.last.ttft_ms if self.last else None

    @property
    def seen_ttft_ms(self) -> float | None:
        """TTFT as the person saw it: Enter to the first character on the screen."""
        return self.seen.ttft_ms

    @property
    def screen_tokens_per_s(self) -> float | None:
        """Tokens that reached the screen per wall second since the reply's first text."""
        return self.seen.tokens_per_s

    @property
    def prompt_tokens_per_s(self) -> float | None:
        return self.last.prefill_tokens_per_s if self.last else None

    # --- rendering --------------------------------------------------------------------
    def _fmt(self, v: float | None, unit: str) -> str:
        if self.freeze_timing:
            # whether a figure exists can depend on timing too (a rate needs two writes), so
            # frozen figures appear together, as soon as a reply has reported anything
            return f"(frozen) {unit}" if self.last is not None else "—"
        if v is None:
            return "—"
        return f"{v:.2f} {unit}" if v < 100 else f"{v:.0f} {unit}"

    def _set(self, row: str, markup: str) -> None:
        """Show `markup` in the row `row` (a Static's id), with a layout pass only if its
        shape may change: another number of lines, or a line wider than the row."""
        old = self._shown.get(row)
        if old == markup:
            return
        self._shown[row] = markup
        widget = self.query_one(f"#{row}", Static)
        width = widget.content_size.width

        def fits(text: str) -> bool:
            return all(Content.from_markup(line).cell_length <= width
                       for line in text.split("\n"))
        same_shape = (old is not None and width > 0 and old.count("\n") == markup.count("\n")
                      and fits(old) and fits(markup))
        widget.update(markup, layout=not same_shape)

    def _refresh(self) -> None:
        if self._redraw_timer is not None:
            self._redraw_timer.stop()
            self._redraw_timer = None
        if self._held:
            self._pending = True
            return
        if not self.is_mounted:
            return
        self._drawn_at = time.monotonic()
        info, last, fmt = self.info, self.last, self._fmt
        q, put = self.query_one, self._set
        if info is None:
            put("perf-backend", "backend   [dim]no model loaded[/]")
            put("perf-model", "model     —")
            put("perf-mode", "mode      —")
        else:
            backend = f"backend   [b]{info.backend}[/] ({info.device})"
            if info.fallback:
                backend += f"\n[dim]{info.fallback}[/]"
            put("perf-backend", backend)
            put("perf-model", f"model     {info.model}")
            if len(info.modes) == 1:
                # Say plainly that the toggle has nothing to switch to here.
                mode = f"mode      [b]{info.mode}[/] [dim](only mode here)[/]"
            else:
                other = [m for m in info.modes if m != info.mode]
                mode = f"mode      [b]{info.mode}[/] [dim](ctrl+g: {'/'.join(other)})[/]"
            put("perf-mode", mode)
        tag = f" [dim]({last.mode})[/]" if last else ""
        spec = ""
        if last is not None and last.spec:
            # speculation: the effective rate above; here how much of the drafting was kept
            kept = f"{100 * last.n_accepted / last.n_drafted:.0f}%" if last.n_drafted else "—"
            per = last.tokens_per_verify_step
            per = "—" if per is None else f"{per:.1f}"   # counts, not timing: never frozen
            spec = (f"\n{_INDENT}{per} [dim]tokens a verify step[/]"
                    f"\n{_INDENT}{kept} [dim]of {last.n_drafted} drafted kept "
                    f"({SPECULATION_NAMES.get(last.spec, last.spec)})[/]")
        put("perf-decode",
            f"decode    {fmt(self.decode_tokens_per_s, 'tok/s')}{tag}\n"
            f"{_INDENT}{fmt(self.decode_median_ms, 'ms/tok')} [dim]median[/]{spec}")
        put("perf-screen",
            f"screen    {fmt(self.screen_tokens_per_s, 'tok/s')}")
        put("perf-ttft",
            f"TTFT      {fmt(self.ttft_ms, 'ms')} [dim]engine[/]\n"
            f"{_INDENT}{fmt(self.seen_ttft_ms, 'ms')} [dim]seen[/]")
        put("perf-prompt", f"prompt    {fmt(self.prompt_tokens_per_s, 'tok/s')}")
        if self.has_class("-line"):
            self._summary()
        spark = q("#perf-spark", Sparkline)
        data = [] if self.freeze_timing else self._rates
        if spark.data != data:
            spark.data = data[:]  # a new list: reactive
        max_ctx = info.max_context if info else 0
        if max_ctx and self.kv_len > max_ctx:
            # the conversation is longer than the context: the next prompt leaves out its
            # oldest turns (session.py), so the context is full, not over 100%
            put("perf-context", f"context   {max_ctx} / {max_ctx} (100%)\n"
                                f"{_INDENT}[dim]older turns left out[/]")
        else:
            pct = f" ({100 * self.kv_len / max_ctx:.0f}%)" if max_ctx else ""
            put("perf-context", f"context   {self.kv_len} / {max_ctx}{pct}")

    def _summary(self) -> None:
        """The folded panel's one line: engine rate, screen rate, both TTFTs, context, mode."""
        info, fmt = self.info, self._fmt
        if info is None:
            self._set("perf-line", "[dim]no model loaded · F3: perf panel[/]")
            return
        max_ctx = info.max_context
        ctx = f"{min(100.0, 100 * self.kv_len / max_ctx):.0f}%" if max_ctx else "—"
        self._set("perf-line",
                  f"[b]{fmt(self.decode_tokens_per_s, 'tok/s')}[/] [dim]engine[/] · "
                  f"{fmt(self.screen_tokens_per_s, 'tok/s')} [dim]screen[/] · "
                  f"TTFT {fmt(self.seen_ttft_ms, 'ms')} · ctx {ctx} · {info.mode} "
                  f"[dim]· F3[/]")
