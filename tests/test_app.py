"""nanoqwen-chat driven for real: the App under `run_test()`, the tiny random-weight model
(tests/helpers.py, a real BPE tokenizer) on the reference backend, the real store and
settings files (redirected to tmp dirs with XDG_CONFIG_HOME / XDG_DATA_HOME). No mock engine.

Replies use greedy decoding so a reply can be compared with a direct ChatSession run.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import json
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nanoqwen.app import widgets
from nanoqwen.app.chat import CHAT_ACTIONS
from nanoqwen.app.main import NanoqwenApp
from nanoqwen.app.screens import (ChatEditScreen, ChatsScreen, ConfirmScreen, ExportScreen,
                                  HelpScreen, ModelScreen, SettingsScreen)
from nanoqwen.app.settings import Settings, default_settings_path, load_settings, save_settings
from nanoqwen.app.store import ChatStore
from nanoqwen.app.widgets import AssistantMessage, CodeFence, PromptInput, UserMessage
from nanoqwen.engine import loader
from nanoqwen.engine.sampling import SamplerParams
from nanoqwen.engine.session import ChatSession, TextDelta
from textual.widgets import Input

SIZE = (110, 32)


def aio(fn):
    """Run an async test with asyncio.run (no pytest-asyncio dependency); pytest still sees
    the fixtures in the wrapped signature."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        return asyncio.run(fn(*args, **kwargs))
    return run


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    """Settings and history in tmp dirs (platformdirs honours the XDG variables)."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.delenv("NANOQWEN_FREEZE_PERF", raising=False)
    return tmp_path


def use_settings(**kw) -> Settings:
    s = Settings(**{"greedy": True, "max_new_tokens": 24, "model_sampler": False, **kw})
    save_settings(s)
    return s


async def wait_for(pilot, cond, timeout: float = 60.0, what: str = "condition") -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await pilot.pause(0.02)


async def loaded(app, pilot) -> None:
    await wait_for(pilot, lambda: app.engine is not None, what="the model to load")


async def send(app, pilot, text: str | None) -> AssistantMessage:
    """Put `text` in the prompt (None: keep what was typed) and press Enter; the reply's
    widget (the reply may already have finished: the tiny model is fast)."""
    n = len(app.chat.shown_messages(AssistantMessage))
    if text is not None:
        app.chat.query_one("#prompt", PromptInput).text = text
    await pilot.press("enter")
    await wait_for(pilot, lambda: len(app.chat.shown_messages(AssistantMessage)) > n, 10,
                   "the reply to start")
    return app.chat.shown_messages(AssistantMessage)[-1]


async def reply_done(app, pilot, timeout: float = 90.0) -> None:
    await wait_for(pilot, lambda: not app.chat.generating, timeout, "the reply to finish")
    await pilot.pause(0.05)


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def notes(app) -> list[str]:
    return [n.message for n in app._notifications]


def greedy_reply(model_path: Path, history: list[dict], text: str, n: int,
                 system_prompt: str | None = None, transcript=None) -> str:
    """The same turn straight through the engine, no app in between (`transcript`: a copy of
    the engine service's before the turn, where the history continues its replies)."""
    eng = loader.load(model_path, backend="reference")
    s = ChatSession(eng.backend, eng.tokenizer, system_prompt=system_prompt, messages=history,
                    transcript=transcript)
    out = "".join(e.text for e in s.generate(text, SamplerParams.greedy_params(), n)
                  if isinstance(e, TextDelta))
    eng.close()
    return out


# --- streaming ---------------------------------------------------------------------------
@aio
async def test_the_first_texts_frame_renders_the_message_column_alone(dirs, tiny_model_path,
                                                                      monkeypatch):
    """A frame renders the screen region bounding everything that changed since the last
    one (the heap is frozen once the model is loaded, and thawed when the app ends). What the
    turn changes outside the message column (the perf panel's figures, the new chat's title)
    waits for the frame after the first text's (_FirstFrame): that frame covers the chat
    column alone, then the panel and the title follow."""
    from textual._compositor import Compositor
    from textual.geometry import Region
    from nanoqwen.app import chat

    monkeypatch.setattr(chat, "FIRST_TEXT_WAIT", 3600.0)   # the text ends the wait, not time
    frames = []   # (region rendered, the reply's text then, the title then)
    orig = Compositor.render_update

    def render_update(self, full=False, screen_stack=None, simplify=False):
        dirty = list(self._dirty_regions)
        if full or self.size.region in self._dirty_regions or not dirty:
            crop = self.size.region if (full or dirty) else None
        else:
            crop = Region.from_union(dirty).intersection(self.size.region)
        r = getattr(app, "chat", None) and app.chat.last_reply
        reply = r.widget if r else None
        frames.append((crop, reply.source if reply is not None else None, app.title))
        return orig(self, full, screen_stack, simplify)

    monkeypatch.setattr(Compositor, "render_update", render_update)
    use_settings(max_new_tokens=12)
    app = NanoqwenApp(model=tiny_model_path)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(app, pilot)
        # what is alive once the model is loaded is frozen (app/heap.py)
        await wait_for(pilot, lambda: gc.get_freeze_count() > 0, 10, "the heap to settle")
        await pilot.pause(0.2)
        column = app.chat.query_one("#chat-col").region
        app.chat.query_one("#prompt", PromptInput).text = "hello"
        await pilot.pause(0.1)                                 # its frame
        frames.clear()
        await pilot.press("enter")
        await wait_for(pilot, lambda: any(src for _, src, _ in frames), 30, "the first text")
        first = next(i for i, (_, src, _) in enumerate(frames) if src)
        crop, text, title = frames[first]
        assert column.contains_region(crop), (crop, column)
        assert title == "nanoqwen-chat"                        # the new title: next frame
        await reply_done(app, pilot)
        assert app.title == "nanoqwen-chat — hello"
        assert app.chat.perf.seen_ttft_ms is not None
        assert "seen" in str(app.chat.query_one("#perf-ttft").render())
    assert gc.isenabled() and gc.get_freeze_count() == 0     # Python's own policy again


@aio
async def test_the_prompt_empties_once_the_first_text_is_on_screen(dirs, tiny_model_path,
                                                                   monkeypatch):
    """The prompt keeps the sent text until the reply's first text has had its frame
    (ChatScreen._submitted: the new messages' frame then leaves the prompt alone), then
    empties; text typed after the sent one stays, a recalled or edited prompt is left as is."""
    from textual._compositor import Compositor
    from nanoqwen.app import chat

    monkeypatch.setattr(chat, "FIRST_TEXT_WAIT", 3600.0)   # the text ends the wait, not time
    frames = []   # (the reply's text, the prompt's text) at each frame
    orig = Compositor.render_update

    def render_update(self, full=False, screen_stack=None, simplify=False):
        r = getattr(app, "chat", None) and app.chat.last_reply
        if r is not None:
            frames.append((r.widget.source, app.chat.query_one("#prompt", PromptInput).text))
        return orig(self, full, screen_stack, simplify)

    monkeypatch.setattr(Compositor, "render_update", render_update)
    use_settings(max_new_tokens=12)
    app = NanoqwenApp(model=tiny_model_path)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(app, pilot)
        prompt = app.chat.query_one("#prompt", PromptInput)
        await send(app, pilot, "hello")
        await reply_done(app, pilot)
        await wait_for(pilot, lambda: prompt.text == "", 10, "the prompt to empty")
        first = next(i for i, (src, _) in enumerate(frames) if src)
        assert all(p == "hello" for _, p in frames[:first + 1])  # through the text's frame
        assert prompt.prompts[-1] == "hello"                     # Up recalls it at once
        # what came into the prompt after Enter
        for before, after in (("hello and more", " and more"), ("hello", ""),
                              ("edited", "edited")):
            prompt.text = before
            prompt.sent_shown("hello")
            assert prompt.text == after
        prompt.text = ""
        await pilot.press("up")                                  # a recalled prompt stays
        prompt.sent_shown("hello")
        assert prompt.text == "hello"


class _Terminal:
    """What a terminal shows after the app's frames: each frame's segments applied to a grid
    of cells (character, colours, attributes), as the terminal would apply them."""

    def __init__(self, width: int, height: int) -> None:
        self.cells = [[(" ", None)] * width for _ in range(height)]

    @staticmethod
    def _look(style):
        if style is None:
            return None
        return (style.color, style.bgcolor, style.bold, style.dim, style.italic,
                style.underline, style.reverse, style.strike)

    def apply(self, console, update) -> None:
        from rich.cells import cell_len
        from rich.segment import ControlType

        x = y = 0
        for seg in update.__rich_console__(console, console.options):
            if seg.control:
                for c in seg.control:
                    if c[0] == ControlType.CURSOR_MOVE_TO:
                        x, y = c[1], c[2]
                continue
            for ch in seg.text:
                if ch == "\n":
                    x, y = 0, y + 1
                    continue
                if 0 <= y < len(self.cells) and 0 <= x < len(self.cells[y]):
                    self.cells[y][x] = (ch, self._look(seg.style))
                x += cell_len(ch)

    def full_render(self, app) -> list:
        """The screen rendered from scratch: every widget's line cache emptied first (a line
        kept from an earlier size, widgets.OnePassLayout, must be what a fresh render gives)."""
        for w in app.screen.walk_children(with_self=True):
            w._styles_cache.clear()
        grid = _Terminal(len(self.cells[0]), len(self.cells))
        x = y = 0
        for y, strip in enumerate(app.screen._compositor.render_strips()):
            x = 0
            for seg in strip:
                for ch in seg.text:
                    grid.cells[y][x] = (ch, self._look(seg.style))
                    x += 1
        return grid.cells


@aio
async def test_partial_frames_show_what_textuals_own_would(dirs, tiny_model_path,
                                                           monkeypatch):
    """frames.py: a partial frame renders only the widgets whose visible part overlaps its
    region. Every partial frame of two streamed turns (the new messages, the first text,
    each append, the perf panel, the prompt emptying, the reply's end) is made both ways at
    the same moment, from the same dirty regions: applied to the terminal (what it showed
    before), both leave it the same, cell for cell, colours and attributes included. Once a
    turn has settled, the terminal is what a full render of the screen shows."""
    import copy

    from textual._compositor import Compositor
    from nanoqwen.app import frames

    compared = []
    term = _Terminal(*SIZE)
    textual_renders = frames._textual_get_renders
    orig_partial = Compositor.render_partial_update

    def render_partial_update(self):
        dirty = set(self._dirty_regions)
        ours_now = Compositor._get_renders
        Compositor._get_renders = textual_renders
        try:
            theirs = orig_partial(self)
        finally:
            Compositor._get_renders = ours_now
        self._dirty_regions.update(dirty)
        ours = orig_partial(self)
        if ours is not None and app.screen._compositor is self:
            a, b = copy.deepcopy(term), copy.deepcopy(term)
            a.apply(app.console, theirs)
            b.apply(app.console, ours)
            compared.append(a.cells == b.cells)
        return ours

    monkeypatch.setattr(Compositor, "render_partial_update", render_partial_update)
    use_settings(max_new_tokens=80)
    app = NanoqwenApp(model=tiny_model_path)
    async with app.run_test(size=SIZE) as pilot:
        assert Compositor._get_renders is frames._get_renders   # installed while it runs
        orig = app._display

        def display(screen, renderable):
            orig(screen, renderable)
            if renderable is not None and screen is app.screen:
                term.apply(app.console, renderable)
        app._display = display
        await loaded(app, pilot)
        app.screen.refresh()                    # a full frame: the terminal's starting state
        await pilot.pause(0.2)
        for text in ("def add", "and a class with a method"):
            await send(app, pilot, text)
            await reply_done(app, pilot)
            await pilot.pause(0.6)              # settled: the panel, the prompt, the blink
            assert term.cells == term.full_render(app)
    assert len(compared) >= 10 and all(compared), compared
    assert Compositor._get_renders is frames._textual_get_renders  # Textual's after the app


@aio
async def test_a_growing_reply_keeps_only_the_lines_a_fresh_render_would_draw(
        dirs, tiny_model_path):
    """widgets.OnePassLayout keeps a resized message's rendered lines above its bottom gutter
    (Textual would drop them all): after every append of a reply that grows a bordered code
    block, a paragraph and a list, and after a narrower screen, the screen rendered from the
    caches as they are equals the screen rendered from empty caches, line for line, styles
    included."""
    def screen_lines(app, fresh: bool) -> list:
        if fresh:
            for w in app.screen.walk_children(with_self=True):
                w._styles_cache.clear()
        return [[(seg.text, seg.style) for seg in strip]
                for strip in app.screen._compositor.render_strips()]

    code = "".join(f"    total_{i} = compute(x, {i})  # step {i}\n" for i in range(30))
    reply = (f"Here is the code:\n\n```python\ndef run(x):\n{code}    return x\n```\n\n"
             "It computes the steps in order and:\n\n- keeps each total\n- returns x\n")
    app = NanoqwenApp(model=tiny_model_path)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(app, pilot)
        box = app.chat.query_one("#messages")
        for _ in range(3):   # earlier messages, so that the list scrolls as the reply grows
            await box.mount(AssistantMessage("a reply\n\nof two paragraphs", None, "stop"))
        widget = AssistantMessage("", None, finish=None, streaming=True)
        await box.mount(widget)
        box.scroll_end(animate=False)
        stream = AssistantMessage.get_stream(widget, None)
        for i in range(0, len(reply), 23):
            await stream.write(reply[i:i + 23])
            await pilot.pause(0.03)
            cached = screen_lines(app, fresh=False)
            assert cached == screen_lines(app, fresh=True), f"after {i + 23} characters"
        await stream.stop()
        assert widget.query(CodeFence)   # (with the code block's gutter not redrawn: fails)
        await pilot.resize_terminal(SIZE[0] - 17, SIZE[1])   # a new width: nothing is kept
        await pilot.pause(0.1)
        assert screen_lines(app, fresh=False) == screen_lines(app, fresh=True)


@pytest.mark.slow
@aio
async def test_prompt_streams_a_reply_that_matches_the_engine(dirs, tiny_model_path):
    n = 300
    use_settings(max_new_tokens=n)
    app = NanoqwenApp(model=tiny_model_path)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(app, pilot)
        assert app.chat.perf.info.backend == "reference"
        # the loader's progress reached the bar (then the bar was hidden)
        bar = app.chat.query_one("#loading-bar")
        assert bar.total and bar.progress == bar.total
        assert not app.chat.query_one("#loading").has_class("-active")
        await pilot.press(*"def add")
        widget = await send(app, pilot, None)
        reply = app.chat.last_reply
        # an engine on the CPU: the stream keeps the UI's CPU under its share (widgets.py)
        assert reply.stream.cpu_share == widgets.CPU_ENGINE_UI_SHARE > 0
        await reply_done(app, pilot)
        final = widget.source
        expected = greedy_reply(tiny_model_path, [], "def add", n)
        assert final == expected and final
        # the text came in several batches (each ~40 ms of tokens), not one per token or
        # all at the end; partial text on screen mid-stream is checked in the stop test
        assert 1 < reply.batches < n
        chat = app.chat.chat_id
        msgs = app.store.messages(chat)
        assert [(m.role, m.content) for m in msgs] == [("user", "def add"), ("assistant", final)]
        assert msgs[1].finish == "length" and msgs[1].stats["n_generated"] == n
        perf = app.chat.perf
        # figures are the engine's (StepEvent timings), present once a reply ran
        assert perf.ttft_ms > 0 and perf.median_ms > 0 and len(perf.steps_ms) == n - 1
        assert perf.kv_len == msgs[1].stats["kv_len"] > n
        assert perf.decode_tokens_per_s > 0 and perf.decode_median_ms > 0
        assert perf.prompt_tokens_per_s == msgs[1].stats["prefill_tokens_per_s"] > 0
        # ... and what the screen saw: Enter comes before the prefill the engine's TTFT times
        assert perf.seen_ttft_ms >= perf.ttft_ms and perf.screen_tokens_per_s > 0
        assert msgs[1].stats["seen_ttft_ms"] == perf.seen_ttft_ms
        assert app.chat.query_one("#prompt", PromptInput).text == ""


@aio
async def test_perf_panel_times_what_reached_the_screen_on_the_ui_clock(dirs, tiny_model_path):
    """The seen figures come from the chat screen's clock at Enter and at each text batch
    written to the Markdown stream; on a test clock (0 at Enter, +0.25 s per reading) they are
    exact, whatever this machine's speed."""
    use_settings(max_new_tokens=60)
    app = NanoqwenApp(model=tiny_model_path)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(app, pilot)
        ticks: list[float] = []

        def clock() -> float:
            ticks.append(0.25 * len(ticks))
            return ticks[-1]

        app.chat.clock = clock
        await send(app, pilot, "hello")
        await reply_done(app, pilot)
        perf, r = app.chat.perf, app.chat.last_reply
        assert len(ticks) == 1 + r.batches      # Enter, then one reading per text batch
        assert perf.seen_ttft_ms == 250.0
        (t1, n1), (tk, nk) = perf.seen.first, perf.seen.last
        assert (t1, tk) == (0.25, 0.25 * r.batches) and 1 <= n1 <= nk <= 60
        if r.batches > 1:
            assert perf.screen_tokens_per_s == (nk - n1) / (tk - t1)
        assert "250 ms seen" in str(app.chat.query_one("#perf-ttft").render())


@aio
async def test_the_chat_screen_is_usable_at_80x24(dirs, tiny_model_path):
    """Every perf row and the prompt stay on screen in a small terminal (with the fallback
    line of the auto backend on a machine without CUDA)."""
    use_settings(max_new_tokens=8)
    app = NanoqwenApp(model=tiny_model_path)
    async with app.run_test(size=(80, 24)) as pilot:
        await loaded(app, pilot)
        await send(app, pilot, "hi")
        await reply_done(app, pilot)
        for sel in ("#perf-backend", "#perf-mode", "#perf-decode", "#perf-screen", "#perf-ttft",
                    "#perf-prompt", "#perf-spark", "#perf-context", "#prompt"):
            w = app.chat.query_one(sel)
            geo = app.screen.find_widget(w)
            assert geo.region.area > 0 and geo.visible_region == geo.region, sel


def on_screen(app, widget) -> bool:
    """The whole widget is inside what the screen shows (not clipped, not scrolled away)."""
    try:
        geo = app.screen.find_widget(widget)
    except Exception:  # noqa: BLE001 - NoWidget: not on screen at all
        return False
    return geo.region.area > 0 and geo.visible_region == geo.region


@pytest.mark.parametrize("size", [(80, 24), (60, 20)])
@aio
async def test_small_terminals_keep_40_columns_for_the_chat_and_f3_folds_the_panel(
        dirs, tiny_model_path, size):
    """At 80x24 the panel fits beside a conversation of >= 40 columns; at 60x20 it folds to
    its one line by itself. F3 cycles full / line / hidden, the choice is saved and comes
    back after a restart; the conversation and the prompt stay whole throughout."""
    from nanoqwen.app.chat import CHAT_MIN_COLUMNS

    use_settings(max_new_tokens=8)
    narrow = size[0] < 76
    app = NanoqwenApp(model=tiny_model_path)
    async with app.run_test(size=size) as pilot:
        await loaded(app, pilot)
        await send(app, pilot, "hi")
        await reply_done(app, pilot)
        chat, panel = app.chat, app.chat.perf
        col = chat.query_one("#chat-col")

        def state():
            return "hidden" if not panel.display else ("line" if panel.has_class("-line")
                                                       else "full")
        seen = []
        for _ in range(3):
            seen.append(state())
            assert col.size.width >= CHAT_MIN_COLUMNS
            assert on_screen(app, chat.query_one("#prompt"))
            if state() == "line":
                line = chat.query_one("#perf-line")
                assert on_screen(app, line) and line.size.height == 1
                assert "engine" in line.render().plain and "ctx" in line.render().plain
                assert col.size.width == size[0]
            elif state() == "full":
                assert on_screen(app, chat.query_one("#perf-context"))
            await pilot.press("f3")
            await pilot.pause()
        assert seen == (["line", "hidden", "line"] if narrow else ["full", "line", "hidden"])
        saved = load_settings()[0].perf_panel
    assert saved == ("hidden" if narrow else "full")
    app = NanoqwenApp(model=tiny_model_path)
    async with app.run_test(size=size) as pilot:
        await loaded(app, pilot)
        assert app.chat.perf.display == (saved != "hidden")


@aio
async def test_the_dialogs_stay_usable_at_60x20(dirs, tiny_model_path):
    """Settings, Help, Chats and the model dialog at 60x20: title and buttons on screen, and
    what does not fit scrolls (the last field or key can be reached)."""
    use_settings()
    seed_chat("add two numbers", CODE_CHAT)
    app = NanoqwenApp(model=tiny_model_path)
    async with app.run_test(size=(60, 20)) as pilot:
        await loaded(app, pilot)
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen), what="Settings")
        await pilot.pause()
        s = app.screen
        assert s.has_class("-short")
        for sel in ("#settings-title", "#save", "#cancel", "#model-defaults"):
            assert on_screen(app, s.query_one(sel)), sel
        prompt = s.query_one("#system_prompt")
        assert not on_screen(app, prompt)          # below the fold ...
        prompt.focus()
        await wait_for(pilot, lambda: on_screen(app, prompt), 10, "the form to scroll")
        assert on_screen(app, s.query_one("#save"))  # ... scrolled to, the buttons still there
        await pilot.press("escape")
        await pilot.pause()
        await pilot.press("f1")
        await wait_for(pilot, lambda: isinstance(app.screen, HelpScreen), what="Help")
        await pilot.pause()
        h = app.screen
        keys = h.query_one("#help-keys")
        last = list(h.query(".help-desc"))[-1]
        assert on_screen(app, h.query_one("#help-title")) and on_screen(app, h.query_one(
            "#help-footer"))
        assert not on_screen(app, last)
        keys.scroll_end(animate=False)
        await wait_for(pilot, lambda: on_screen(app, last), 10, "help to scroll")
        await pilot.press("escape")
        await pilot.pause()
        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: isinstance(app.screen, ChatsScreen), what="Chats")
        await pilot.pause()
        for sel in ("#chats-title", "#chats-list", "#chats-footer"):
            assert on_screen(app, app.screen.query_one(sel)), sel
        await pilot.press("escape")
        await pilot.pause()
        # the model dialog as the error screen, with a reason longer than the terminal
        app.push_screen(ModelScreen("x.nanoqwen", "a reason that goes on and on. " * 40))
        await pilot.pause()
        await pilot.pause()
        m = app.screen
        assert m.has_class("-short")
        for sel in ("#path-title", "#path-input", "#ok", "#cancel"):
            assert on_screen(app, m.query_one(sel)), sel


@pytest.mark.slow
@aio
async def test_esc_stops_keeps_partial_reply_and_keys_work_while_streaming(dirs, tiny_model_path):
    # plain decoding: the pacing below wraps the backend's generate(), which speculation's
    # loop does not call
    use_settings(max_new_tokens=3000, speculation="off")
    store = ChatStore()   # a long earlier chat, so the message list overflows and scrolls
    chat = store.new_chat("long", "tiny")
    for i in range(8):
        store.add_message(chat, "user", f"question {i}")
        store.add_message(chat, "assistant", f"answer {i}\n\n" + "lorem ipsum " * 30, "stop")
    store.close()
    app = NanoqwenApp(model=tiny_model_path)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(app, pilot)
        # The real engine, paced by the test: each token waits for a permit, so the reply is
        # still streaming when Esc comes however fast this machine decodes (unpaced, a fast
        # engine filled the context first and the turn ended "context").
        be = app.engine.backend
        permits, unpaced = threading.Semaphore(0), be.generate

        def paced(*a, **k):
            for ev in unpaced(*a, **k):
                permits.acquire(timeout=60)
                yield ev
        be.generate = paced
        permits.release(80)
        box = app.chat.query_one("#messages")
        await send(app, pilot, "go on")
        r = app.chat.last_reply
        await wait_for(pilot, lambda: len(r.widget.source) > 20, 30, "streamed text on screen")
        assert app.chat.generating and r.text.startswith(r.widget.source)
        # keys work while the reply streams: type into the prompt, Ctrl+J adds a newline
        await pilot.press("a", "b", "ctrl+j", "c")
        assert app.chat.query_one("#prompt", PromptInput).text == "ab\nc"
        assert app.chat.generating
        # the view follows the stream ...
        await wait_for(pilot, lambda: box.scroll_y == box.max_scroll_y > 0, 10, "following")
        # ... until the user scrolls up to read; then it stays where they are
        box.scroll_home(animate=False)
        await pilot.pause(0.2)
        n = len(r.text)
        permits.release(80)
        await wait_for(pilot, lambda: len(r.text) > n + 10, 30, "more text")
        assert box.scroll_y < box.max_scroll_y - 5
        await pilot.press("escape")
        permits.release(8)   # the paced token yields; the session sees the cancel after it
        await reply_done(app, pilot)
        be.generate = unpaced
        m = app.store.messages(app.chat.chat_id)[-1]
        assert m.role == "assistant" and m.finish == "cancelled"
        assert m.content == r.widget.source == r.text and len(m.content) > 20
        assert r.widget.border_subtitle == "stopped"
        # the session is usable after a stop: the next message gets a reply
        app.settings.max_new_tokens = 5
        await send(app, pilot, "next")
        await reply_done(app, pilot)
        assert app.store.messages(app.chat.chat_id)[-1].finish == "length"


@aio
async def test_toggle_decode_mode_on_reference_says_there_is_only_eager(dirs, tiny_model_path):
    use_settings()
    app = NanoqwenApp(model=tiny_model_path)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(app, pilot)
        await pilot.press("ctrl+g")
        await pilot.pause()
        assert app.engine.mode == "eager"
        assert any("only eager decode" in n for n in notes(app))
        assert "(only mode here)" in str(app.chat.query_one("#perf-mode").render())
        # a reply runs in the mode the perf panel names
        await send(app, pilot, "hi")
        await reply_done(app, pilot)
        assert app.chat.perf.last.mode == "eager"


@aio
async def test_settings_offer_only_the_backends_decode_modes_and_keep_the_saved_one(
        dirs, tiny_model_path):
    use_settings(decode_mode="graph")      # chosen for the CUDA backend
    app = NanoqwenApp(model=tiny_model_path)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(app, pilot)
        assert app.engine.info.modes == ("eager",)
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert app.focused is app.screen.query_one("#greedy")    # its first field
        select = app.screen.query_one("#decode_mode")
        assert [o[1] for o in select._options] == ["eager"] and select.value == "eager"
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert not isinstance(app.screen, SettingsScreen)
    # saved on the CPU, the CUDA backend's choice is still there for a machine that has it
    assert json.loads(default_settings_path().read_text())["decode_mode"] == "graph"


@aio
async def test_speculation_setting_gives_the_same_reply_and_shows_what_was_kept(
        dirs, tiny_model_path):
    """Prompt lookup on (a saved setting, applied when the model loads): the reply is the
    greedy one token for token, the perf panel says how much of the drafting was kept, the
    stored stats carry the figures; the settings screen offers it on this backend."""
    n = 120
    use_settings(max_new_tokens=n, speculation="ngram")
    app = NanoqwenApp(model=tiny_model_path)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(app, pilot)
        assert app.engine.spec == "ngram"
        text = "def add(a, b): return a + b\ndef add(a, b): return a + b\ndef add"
        app.chat.query_one("#prompt", PromptInput).text = text
        widget = await send(app, pilot, None)
        await reply_done(app, pilot)
        assert widget.source == greedy_reply(tiny_model_path, [], text, n)
        st = app.store.messages(app.chat.chat_id)[1].stats
        assert st["spec"] == "ngram" and st["n_drafted"] > 0
        assert 0 <= st["n_accepted"] <= st["n_drafted"]
        decode = str(app.chat.perf.query_one("#perf-decode").render())
        assert f"of {st['n_drafted']} drafted kept (prompt lookup)" in decode, decode
        if st["n_verify_steps"]:   # the tokens a verify step gave: kept drafts + its own
            per = (st["n_accepted"] + st["n_verify_steps"]) / st["n_verify_steps"]
            assert f"{per:.1f} tokens a verify step" in decode, decode
        await pilot.press("ctrl+s")
        await pilot.pause()
        select = app.screen.query_one("#speculation")
        assert [o[1] for o in select._options] == ["auto", "off", "ngram", "draft"]
        assert select.value == "ngram"
        select.value = "off"
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert app.engine.spec is None and app.settings.speculation == "off"
    assert json.loads(default_settings_path().read_text())["speculation"] == "off"


@aio
async def test_a_draft_model_setting_drafts_or_says_why_not(dirs, tiny_model_path, tmp_path):
    """Speculation with a draft model: the model file as its own draft (the same tokenizer)
    drafts in a worker and the reply is the greedy one token for token; a file of another
    tokenizer (the bundled model's) or a missing file is refused with a notification naming
    it, and replies decode plainly; the settings screen wants a file for "draft model"."""
    from nanoqwen.engine.service import default_model_path

    n = 60
    use_settings(max_new_tokens=n, speculation="draft", draft_model=str(tiny_model_path))
    app = NanoqwenApp(model=tiny_model_path)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(app, pilot)
        # the worker sets the engine's drafter and then posts DraftReady: wait for the
        # notification (the last of the two), not for engine.spec (CI ran ahead of it)
        await wait_for(pilot, lambda: any("Drafting with tiny.nanoqwen" in m
                                          for m in notes(app)), 60, "the draft model")
        assert app.engine.spec == "draft"
        assert app.engine.draft_path == tiny_model_path.resolve()
        text = "def add(a, b): return a + b"
        widget = await send(app, pilot, text)
        await reply_done(app, pilot)
        assert widget.source == greedy_reply(tiny_model_path, [], text, n)
        st = app.store.messages(app.chat.chat_id)[1].stats
        assert st["spec"] == "draft" and st["n_drafted"] > 0 and st["n_verify_steps"] > 0
        for bad, says in [(default_model_path(), "has another tokenizer than"),
                          (tmp_path / "missing.nanoqwen", "does not exist")]:
            app.settings = use_settings(max_new_tokens=n, speculation="draft",
                                        draft_model=str(bad))
            app._apply_speculation()
            await wait_for(pilot, lambda: any(says in m for m in notes(app)), 60, says)
            await pilot.pause(0.05)
            assert any(f"Could not use the draft model {bad}" in m for m in notes(app))
            assert app.engine.spec is None     # plainly, not with the earlier draft model
        # the settings screen: "draft model" without a file is refused on the field
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert isinstance(app.screen, SettingsScreen)
        app.screen.query_one("#speculation").value = "draft"
        app.screen.query_one("#draft_model", Input).value = " "
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert isinstance(app.screen, SettingsScreen)
        hint = str(app.screen.query_one("#draft_model-error").render())
        assert "Draft model is needed" in hint, hint


@aio
async def test_the_models_generation_defaults_are_the_apps_until_changed(dirs):
    """The bundled file's generation config (temperature 0.2, top-k 20, top-p 0.9, min-p
    0.05) is the app's sampler on a fresh install, the same as `nanoqwen generate` uses;
    a changed value is kept over it (also after a restart); "Model's defaults" goes back."""
    from nanoqwen.engine.cli_generate import sampler_params as cli_params
    from nanoqwen.engine.service import default_model_path

    bundled = default_model_path()
    app = NanoqwenApp(model=bundled)           # no settings file: a fresh install
    async with app.run_test(size=SIZE) as pilot:
        await loaded(app, pilot)
        gen = app.engine.info.generation
        assert gen and gen["temperature"] == 0.2
        want = cli_params(argparse.Namespace(), gen)   # the CLI with no sampler flags
        assert app.settings.model_sampler and app.settings.sampler_params() == want
        await pilot.press("ctrl+s")
        field = app.screen.query_one("#top_k")
        field.value = "7"
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert not app.settings.model_sampler and app.settings.top_k == 7
    app = NanoqwenApp(model=bundled)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(app, pilot)
        assert app.settings.top_k == 7 and not app.settings.model_sampler   # kept over the file
        await pilot.press("ctrl+s")
        await pilot.click("#model-defaults")
        assert app.screen.query_one("#top_k").value == "20"
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert app.settings.model_sampler and app.settings.sampler_params() == want
    assert json.loads(default_settings_path().read_text())["model_sampler"] is True


@aio
async def test_the_prompt_recalls_earlier_prompts_and_scrolls_the_conversation(
        dirs, tiny_model_path):
    use_settings(max_new_tokens=60)
    app = NanoqwenApp(model=tiny_model_path)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(app, pilot)
        sent = ["first question", "second\nover two lines", "third"]
        for text in sent:
            await send(app, pilot, text)
            await reply_done(app, pilot)
        prompt = app.chat.query_one("#prompt", PromptInput)
        prompt.focus()
        await pilot.press(*"draft")
        for want in reversed(sent):                    # Up on the first line: back in time
            await pilot.press("up")
            assert prompt.text == want
        await pilot.press("up")
        assert prompt.text == sent[0]                  # the oldest stays
        await pilot.press("down")                      # forward: the cursor at the end
        assert prompt.text == sent[1] and prompt.cursor_location[0] == 1
        await pilot.press("up")                        # not on the first line: Up edits
        assert prompt.text == sent[1] and prompt.cursor_location[0] == 0
        await pilot.press("up")
        assert prompt.text == sent[0]
        await pilot.press("down", "down")              # sent[1] (ends on its last line)
        assert prompt.text == sent[2]
        await pilot.press("down")
        assert prompt.text == "draft"                  # past the newest: the draft again
        # PageUp / PageDown scroll the conversation, not the prompt's cursor
        box = app.chat.query_one("#messages")
        await pilot.pause()
        assert box.max_scroll_y > 0 and box.scroll_y == box.max_scroll_y
        await pilot.press("pageup")
        await pilot.pause()
        assert box.scroll_y < box.max_scroll_y and prompt.text == "draft"
        await pilot.press("pagedown", "pagedown", "pagedown")
        await pilot.pause()
        assert box.scroll_y == box.max_scroll_y
        prompt.clear()
        await pilot.press("home")                      # an empty prompt: Home/End scroll too
        await pilot.pause()
        assert box.scroll_y == 0
        await pilot.press("end")
        await pilot.pause()
        assert box.scroll_y == box.max_scroll_y
        # a reopened chat recalls its own prompts
        app.chat.open_chat(app.chat.chat_id)
        await pilot.pause()
        await pilot.press("up")
        assert prompt.text == sent[-1]


@aio
async def test_the_cpu_threads_setting_and_flag_reach_the_backend(dirs, tiny_model_path):
    from nanoqwen.engine.backends.reference import set_cpu_threads

    before = set_cpu_threads(None)
    try:
        use_settings(cpu_threads=1)
        app = NanoqwenApp(model=tiny_model_path)
        async with app.run_test(size=SIZE) as pilot:
            await loaded(app, pilot)
            assert set_cpu_threads(None) == 1
        if (os.cpu_count() or 1) >= 2:       # the flag wins over the setting
            app = NanoqwenApp(model=tiny_model_path, threads=2)
            async with app.run_test(size=SIZE) as pilot:
                await loaded(app, pilot)
                assert set_cpu_threads(None) == 2
    finally:
        set_cpu_threads(before)


@aio
async def test_sampler_setting_survives_a_restart(dirs, tiny_model_path):
    use_settings()
    app = NanoqwenApp(model=tiny_model_path)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(app, pilot)
        engine = app.engine
        await pilot.press("ctrl+s")
        assert isinstance(app.screen, SettingsScreen)
        for name, value in (("top_k", "7"), ("temperature", "0.5")):
            field = app.screen.query_one(f"#{name}")
            field.value = ""
            field.focus()
            await pilot.press(*value)
        await pilot.click("#greedy")     # sampling instead of greedy
        await pilot.press("ctrl+s")
        await pilot.pause()
        assert not isinstance(app.screen, SettingsScreen)
        assert app.engine is engine       # applied without reloading the model
        assert app.settings.sampler_params() == SamplerParams(temperature=0.5, top_k=7)
    on_disk = json.loads(default_settings_path().read_text())
    assert (on_disk["top_k"], on_disk["temperature"], on_disk["greedy"]) == (7, 0.5, False)

    app = NanoqwenApp(model=tiny_model_path)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(app, pilot)
        assert (app.settings.top_k, app.settings.temperature) == (7, 0.5)
        await pilot.press("ctrl+s")
        assert app.screen.query_one("#top_k").value == "7"


@aio
async def test_invalid_settings_are_rejected_with_a_message(dirs, tiny_model_path):
    use_settings(top_p=0.9)
    app = NanoqwenApp(model=tiny_model_path)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(app, pilot)
        await pilot.press("ctrl+s")
        app.screen.query_one("#top_p").value = "1.7"
        app.screen.query_one("#seed").value = "many"
        await pilot.click("#save")
        await pilot.pause()
        screen = app.screen
        assert isinstance(screen, SettingsScreen)   # still open: nothing was saved
        top_p = str(screen.query_one("#top_p-error").render())
        assert "Top-p must be a number in [0, 1]" in top_p
        assert "Seed must be a whole number" in str(screen.query_one("#seed-error").render())
        assert "2 setting(s) need fixing" in str(screen.query_one("#settings-errors").render())
        await pilot.press("escape")
        assert app.settings.top_p == 0.9
    assert load_settings()[0].top_p == 0.9


@aio
async def test_history_is_there_after_a_restart(dirs, tiny_model_path):
    use_settings(max_new_tokens=12)
    app = NanoqwenApp(model=tiny_model_path)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(app, pilot)
        await send(app, pilot, "remember me")
        await reply_done(app, pilot)
        reply = app.chat.shown_messages(AssistantMessage)[-1].source
    app = NanoqwenApp()   # no --model: the last model used
    async with app.run_test(size=SIZE) as pilot:
        await loaded(app, pilot)
        assert app.engine.info.path == Path(tiny_model_path).resolve()
        users = [w.render().plain for w in app.chat.shown_messages(UserMessage)]
        assert users == ["remember me"]
        assert [w.source for w in app.chat.shown_messages(AssistantMessage)] == [reply]
        assert app.chat.perf.kv_len > 0   # the reopened chat's size in tokens


DRIVER = r"""
import asyncio, sys
from nanoqwen.app.main import NanoqwenApp

async def main():
    app = NanoqwenApp(model=sys.argv[1])
    async with app.run_test(size=(100, 30)) as pilot:
        while app.engine is None:
            await pilot.pause(0.05)
        await pilot.press(*"tell me everything", "enter")
        print("sent", flush=True)
        while True:
            await pilot.pause(0.1)

asyncio.run(main())
"""


@aio
async def test_quitting_mid_reply_keeps_it_as_stopped(dirs, tiny_model_path):
    use_settings(max_new_tokens=3000)
    app = NanoqwenApp(model=tiny_model_path)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(app, pilot)
        await send(app, pilot, "go")
        r = app.chat.last_reply
        await wait_for(pilot, lambda: len(r.text) > 10, 30, "some streamed text")
        await pilot.press("ctrl+q")
    m = ChatStore().messages(app.chat.chat_id)[-1]
    assert m.finish == "cancelled" and m.content.startswith(r.text[:10])


@pytest.mark.slow
@aio
async def test_killed_mid_reply_keeps_what_was_shown(dirs, tiny_model_path):
    use_settings(max_new_tokens=4000)
    db = dirs / "data" / "nanoqwen" / "history.sqlite3"
    proc = subprocess.Popen([sys.executable, "-c", DRIVER, str(tiny_model_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen = None
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < 90 and proc.poll() is None:
            if db.exists():
                con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
                try:
                    row = con.execute("SELECT content FROM messages WHERE role = 'assistant' "
                                      "AND finish IS NULL").fetchone()
                except sqlite3.OperationalError:   # schema not created yet
                    row = None
                con.close()
                if row and len(row[0]) > 30:
                    seen = row[0]
                    break
            await asyncio.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        out, err = proc.communicate(timeout=30)
    assert seen is not None, f"no reply streamed; driver said: {out!r} {err[-2000:]!r}"
    assert proc.returncode == -signal.SIGKILL

    store = ChatStore(db)
    msgs = store.messages(store.latest_chat())
    assert [m.role for m in msgs] == ["user", "assistant"]
    assert msgs[1].finish is None and msgs[1].content.startswith(seen)
    store.close()
    app = NanoqwenApp(model=tiny_model_path)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(app, pilot)
        shown = app.chat.shown_messages(AssistantMessage)[-1]
        assert shown.source == msgs[1].content
        assert "interrupted" in shown.border_subtitle


@aio
async def test_corrupt_model_opens_the_error_screen_then_the_picker_loads_one(
        dirs, tiny_model_path):
    use_settings()
    bad = dirs / "broken.nanoqwen"
    bad.write_bytes(b"\x00garbage" * 1000)
    app = NanoqwenApp(model=bad)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, ModelScreen), 30, "the error screen")
        msg = str(app.screen.query_one("#path-message").render())
        assert "Could not use the model" in msg and str(bad) in msg
        assert app.engine is None
        field = app.screen.query_one("#path-input")
        field.value = str(tiny_model_path)
        field.focus()
        await pilot.press("enter")
        await loaded(app, pilot)
        assert not isinstance(app.screen, ModelScreen)


@pytest.mark.skipif(torch_cuda_available(), reason="the CUDA backend runs on this machine")
@aio
async def test_a_backend_this_machine_cannot_run_is_named_not_the_file(dirs, tiny_model_path):
    use_settings()
    app = NanoqwenApp(model=tiny_model_path, backend="cuda")
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, ModelScreen), 30, "the error screen")
        msg = str(app.screen.query_one("#path-message").render())
        assert "The cuda backend cannot run on this machine" in msg
        assert "was not the problem" in msg and "--backend auto" in msg
        assert "Could not use the model" not in msg and app.engine is None


@aio
async def test_missing_model_says_so(dirs):
    use_settings()
    app = NanoqwenApp(model=dirs / "nowhere.nanoqwen")
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: isinstance(app.screen, ModelScreen), 30, "the error screen")
        assert "does not exist" in str(app.screen.query_one("#path-message").render())
        await pilot.press("escape")   # continue without a model: the app stays up
        await send_without_model(app, pilot)


async def send_without_model(app, pilot) -> None:
    app.chat.query_one("#prompt", PromptInput).text = "hello?"
    await pilot.press("enter")
    await pilot.pause()
    assert any("No model is loaded" in n for n in notes(app))
    assert not app.chat.generating


# --- chat actions -----------------------------------------------------------------------------
@aio
async def test_regenerate_replaces_the_last_reply(dirs, tiny_model_path):
    use_settings(max_new_tokens=10)
    app = NanoqwenApp(model=tiny_model_path)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(app, pilot)
        await send(app, pilot, "first")
        await reply_done(app, pilot)
        before = app.store.messages(app.chat.chat_id)
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: app.store.messages(app.chat.chat_id)[-1].id
                       != before[-1].id, 10, "a new reply row")
        await reply_done(app, pilot)
        after = app.store.messages(app.chat.chat_id)
        assert [m.role for m in after] == ["user", "assistant"]
        assert after[1].content == before[1].content   # greedy: the same reply again
        assert len(app.chat.shown_messages(AssistantMessage)) == 1


@aio
async def test_the_next_turn_waits_mounted_and_hidden_and_enter_shows_those_widgets(
        dirs, tiny_model_path):
    """chat._prepare_next: while nobody waits (the app open, a reply ended, a chat opened)
    the next user message and reply are mounted empty, hidden and last on the list; Enter
    fills and shows those very widgets (no mount after Enter), a regenerated reply takes
    the hidden reply and drops the hidden user message, and another chat replaces them.
    Hidden ones are never counted as messages, and what is stored matches what is shown."""
    from textual.widgets._markdown import MarkdownBlock

    use_settings(max_new_tokens=6)
    app = NanoqwenApp(model=tiny_model_path)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(app, pilot)
        chat = app.chat
        box = chat.query_one("#messages")

        def ready() -> bool:
            pair = chat._next
            return (pair is not None and all(w.is_mounted for w in pair)
                    and bool(pair[1].query(MarkdownBlock)))

        def hidden() -> list:
            return [w for w in box.children if not w.display]
        await wait_for(pilot, ready, 10, "the next turn (app open)")
        user, reply = chat._next
        assert list(box.children)[-2:] == [user, reply] == hidden()
        assert chat.shown_messages() == []
        assert await send(app, pilot, "def add(a, b):") is reply
        await reply_done(app, pilot)
        assert chat.shown_messages() == [user, reply] and user.display and reply.display
        stored = app.store.messages(chat.chat_id)
        assert [m.id for m in stored] == [user.msg_id, reply.msg_id]
        assert user.render().plain == stored[0].content == "def add(a, b):"
        assert reply.source == stored[1].content and "streaming" not in reply.border_subtitle

        await wait_for(pilot, ready, 10, "the next turn (reply ended)")
        user2, reply2 = chat._next
        assert list(box.children)[-2:] == [user2, reply2] == hidden()
        await pilot.press("ctrl+r")
        await wait_for(pilot, lambda: chat.last_reply.widget is reply2, 10, "the new reply")
        await reply_done(app, pilot)
        await pilot.pause(0.1)
        assert user2 not in box.children and reply not in box.children
        assert chat.shown_messages() == [user, reply2]
        stored = app.store.messages(chat.chat_id)
        assert [m.id for m in stored] == [user.msg_id, reply2.msg_id]
        assert reply2.source == stored[1].content

        await wait_for(pilot, ready, 10, "the next turn (regenerated)")
        old = chat._next
        await pilot.press("ctrl+n")
        await wait_for(pilot, lambda: ready() and chat._next is not old, 10,
                       "the next turn (new chat)")
        await pilot.pause(0.1)
        assert not any(w in box.children for w in old) and chat.shown_messages() == []
        assert list(box.children) == list(chat._next) == hidden()


def mounted_ids(app) -> list[int]:
    return [w.msg_id for w in app.chat.shown_messages()]


@aio
async def test_a_long_chat_mounts_its_newest_messages_and_shows_earlier_ones_on_request(
        dirs, tiny_model_path):
    """Every mount reflows every mounted widget, so a long chat mounts its newest
    CHAT_WINDOW messages, a note says how many wait, and page up at the top (or the wheel
    there, or a click on the note) mounts EARLIER_BATCH more above, in order, the view kept
    on what it showed; a reply's end trims a list grown past the window plus a batch."""
    from nanoqwen.app import chat as chat_mod
    from nanoqwen.app.widgets import EarlierMessages

    win, batch = chat_mod.CHAT_WINDOW, chat_mod.EARLIER_BATCH
    use_settings(max_new_tokens=4)
    app = NanoqwenApp(model=tiny_model_path)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(app, pilot)
        store = app.store
        cid = store.new_chat("long one", "m", None)
        ids = []
        for i in range((win + batch) // 2 + 4):   # the window, a full batch, 8 more
            ids.append(store.add_message(cid, "user", f"question {i}"))
            ids.append(store.add_message(cid, "assistant", f"answer {i}", finish="stop"))
        n = len(ids)
        assert win + batch < n < win + 2 * batch
        app.chat.open_chat(cid)
        await pilot.pause(0.2)
        assert mounted_ids(app) == ids[-win:]
        note = app.chat.query_one(EarlierMessages)
        assert f"{n - win} earlier messages" in str(note.render())
        prompt = app.chat.query_one("#prompt", PromptInput)
        prompt.focus()
        await pilot.press("home")               # scrolls to the top first ...
        await pilot.pause(0.1)
        assert mounted_ids(app) == ids[-win:]
        top = app.chat.shown_messages()[0]
        await pilot.press("home")               # ... at the top: the batch before
        await wait_for(pilot, lambda: len(mounted_ids(app)) == win + batch, 5, "a batch")
        assert mounted_ids(app) == ids[-(win + batch):]
        assert f"{n - win - batch} earlier messages" in str(note.render())
        await pilot.pause(0.1)
        box = app.chat.query_one("#messages")
        assert box.scroll_y == pytest.approx(top.virtual_region.y - box.styles.padding.top,
                                             abs=2)   # the view stayed on what it showed
        # two requests at once (a key repeated while a batch mounts): the rest, once each
        await asyncio.gather(app.chat.show_earlier(), app.chat.show_earlier())
        await pilot.pause(0.1)
        assert mounted_ids(app) == ids and not app.chat.query(EarlierMessages)
        # reopened: the window again; at the top, a click on the note shows a batch
        app.chat.open_chat(cid)
        await pilot.pause(0.2)
        assert mounted_ids(app) == ids[-win:]
        prompt.focus()
        await pilot.press("home")               # to the top, where the note is
        await pilot.pause(0.1)
        await pilot.click(EarlierMessages)
        await wait_for(pilot, lambda: len(mounted_ids(app)) == win + batch, 5, "a batch")
        assert mounted_ids(app) == ids[-(win + batch):]
        # a reply at the bottom of a list past window + batch trims it back to the window
        prompt.focus()
        await pilot.press("end")
        prompt.text = "one more"                # (send()'s count of replies would see the trim)
        await pilot.press("enter")
        await wait_for(pilot, lambda: len(store.messages(cid)) == n + 2, 10, "the reply row")
        await reply_done(app, pilot)
        await pilot.pause(0.2)
        all_ids = [m.id for m in store.messages(cid)]
        assert mounted_ids(app) == all_ids[-win:]
        assert f"{len(all_ids) - win} earlier messages" in str(
            app.chat.query_one(EarlierMessages).render())
        # the engine still got the whole conversation (the window is the screen's only)
        assert len(all_ids) == n + 2


@aio
async def test_new_chat_and_reopen_a_past_one(dirs, tiny_model_path):
    use_settings(max_new_tokens=6)
    app = NanoqwenApp(model=tiny_model_path)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(app, pilot)
        await send(app, pilot, "chat one")
        await reply_done(app, pilot)
        first = app.chat.chat_id
        await pilot.press("ctrl+n")
        assert app.chat.chat_id is None and not app.chat.shown_messages(UserMessage)
        await send(app, pilot, "chat two")
        await reply_done(app, pilot)
        assert app.chat.chat_id != first
        await pilot.press("ctrl+o")
        assert isinstance(app.screen, ChatsScreen)
        options = app.screen.query_one("#chats-list")
        assert options.option_count == 2
        await pilot.press("down", "enter")   # the older chat (newest is first)
        await pilot.pause()
        assert app.chat.chat_id == first
        assert [w.render().plain for w in app.chat.shown_messages(UserMessage)] == ["chat one"]


CODE_CHAT = [
    ("user", "add two numbers"),
    ("assistant", "Here:\n\n```python\ndef add(a, b):\n    return a + b\n```\n\n"
                  "And a test:\n\n```python\nassert add(2, 3) == 5\n```\n"),
]


def seed_chat(title: str, turns) -> int:
    store = ChatStore()
    chat = store.new_chat(title, "tiny")
    for role, text in turns:
        store.add_message(chat, role, text, "stop" if role == "assistant" else None)
    store.close()
    return chat


@aio
async def test_copy_code_by_key_and_click_and_export(dirs, tiny_model_path):
    use_settings()
    seed_chat("code", CODE_CHAT)
    app = NanoqwenApp(model=tiny_model_path)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(app, pilot)
        fences = list(app.chat.query(CodeFence))
        assert [f.code for f in fences] == ["def add(a, b):\n    return a + b",
                                            "assert add(2, 3) == 5"]
        await pilot.press("f2")       # the last code block ...
        assert app.clipboard == "assert add(2, 3) == 5" and fences[1].has_class("-copied")
        assert any("Copied python block 2 of 2 (1 line)" in n for n in notes(app))
        await pilot.press("f2")       # ... again: the one before, then round to the last
        assert app.clipboard == "def add(a, b):\n    return a + b"
        assert fences[0].has_class("-copied") and not fences[1].has_class("-copied")
        await pilot.press("f2")
        assert app.clipboard == "assert add(2, 3) == 5"
        app.chat._copied = (float("-inf"), 0, 2)   # as if F2 came long after the last one
        await pilot.press("f2")
        assert app.clipboard == "assert add(2, 3) == 5"   # the last again, not the one before
        await pilot.click(fences[0])
        assert app.clipboard == "def add(a, b):\n    return a + b"
        assert any("Copied a code block (2 lines)" in n for n in notes(app))

        await pilot.press("ctrl+t")
        assert isinstance(app.screen, ExportScreen)
        target = dirs / "export.md"
        app.screen.query_one("#path-input").value = str(target)
        await pilot.press("enter")
        await pilot.pause()
        text = target.read_text()
        assert text.startswith("# code\n")
        assert "```python\ndef add(a, b):\n    return a + b\n```" in text


@aio
async def test_chats_are_searched_renamed_given_their_own_system_prompt_and_deleted(
        dirs, tiny_model_path):
    """The Chats screen: typing filters by title and message text; ctrl+e renames a chat
    and sets its system prompt, which its next reply uses (the reply equals the engine's
    own with that prompt) while new chats keep the settings' prompt; ctrl+d asks first, and
    deleting the open chat leaves a new empty one."""
    use_settings(max_new_tokens=6, system_prompt="")
    sort_id = seed_chat("sorting", [("user", "sort a list"), ("assistant", "use sorted()")])
    seed_chat("dates", [("user", "parse an ISO date"), ("assistant", "fromisoformat")])
    app = NanoqwenApp(model=tiny_model_path)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(app, pilot)
        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: isinstance(app.screen, ChatsScreen), what="Chats")
        chats = app.screen
        assert [c.title for c in chats.chats] == ["dates", "sorting"]
        for ch in "sorted(":                   # in a reply, not in the title
            await pilot.press(ch)
        await pilot.pause()
        assert [c.title for c in chats.chats] == ["sorting"]
        assert "1 chat match" in str(chats.query_one("#chats-count").render())
        await pilot.press("ctrl+e")
        await wait_for(pilot, lambda: isinstance(app.screen, ChatEditScreen), what="the editor")
        edit = app.screen
        edit.query_one("#chat-title").value = "Sorting in Python"
        edit.query_one("#chat-system").text = "You answer in one line."
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: app.screen is chats, what="back to Chats")
        stored = app.store.chat(sort_id)
        assert (stored.title, stored.system_prompt) == ("Sorting in Python",
                                                        "You answer in one line.")
        assert [c.title for c in chats.chats] == ["Sorting in Python"]
        await pilot.press("enter")                  # opens the highlighted chat
        await wait_for(pilot, lambda: app.chat.chat_id == sort_id, what="the chat to open")
        assert app.chat.system_prompt == "You answer in one line."
        widget = await send(app, pilot, "and reversed?")
        await reply_done(app, pilot)
        history = [{"role": "user", "content": "sort a list"},
                   {"role": "assistant", "content": "use sorted()"}]
        assert widget.source == greedy_reply(tiny_model_path, history, "and reversed?", 6,
                                             "You answer in one line.")
        # a new chat starts with the settings' prompt and keeps it
        await pilot.press("ctrl+n")
        await send(app, pilot, "hello")
        await reply_done(app, pilot)
        new_id = app.chat.chat_id
        assert app.store.chat(new_id).system_prompt == ""
        # delete: Cancel keeps it, Delete removes it; the open chat deleted -> a new one
        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: isinstance(app.screen, ChatsScreen), what="Chats")
        assert app.screen.chats[0].id == new_id
        await pilot.press("ctrl+d")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="confirm")
        assert app.screen.focused.id == "no"
        await pilot.press("enter")                  # the focused answer: Cancel
        await wait_for(pilot, lambda: isinstance(app.screen, ChatsScreen), what="Chats")
        assert app.store.chat(new_id) is not None
        await pilot.press("ctrl+d")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen), what="confirm")
        await pilot.click("#yes")
        await wait_for(pilot, lambda: isinstance(app.screen, ChatsScreen), what="Chats")
        assert app.store.chat(new_id) is None and app.store.messages(new_id) == []
        assert new_id not in [c.id for c in app.screen.chats]
        await pilot.press("escape")
        await wait_for(pilot, lambda: app.chat.chat_id is None, what="a new chat")
        assert not app.chat.shown_messages(AssistantMessage)


@aio
async def test_an_export_carries_the_model_the_sampler_and_each_replys_figures(
        dirs, tiny_model_path):
    use_settings(max_new_tokens=5, system_prompt="Be brief.")
    app = NanoqwenApp(model=tiny_model_path)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(app, pilot)
        await send(app, pilot, "hi")
        await reply_done(app, pilot)
        app.settings.greedy = False
        app.settings.temperature = 0.7
        await send(app, pilot, "again")
        await reply_done(app, pilot)
        target = dirs / "chat.md"
        await pilot.press("ctrl+t")
        app.screen.query_one("#path-input").value = str(target)
        await pilot.press("enter")
        await wait_for(pilot, target.exists, 10, "the export")
        md = target.read_text()
        name = app.engine.info.name
        assert f"model: {name}" in md and "**System prompt:**\n\nBe brief." in md
        notes_ = [line for line in md.splitlines() if line.startswith("<sub>")]
        assert len(notes_) == 2
        for note in notes_:
            assert f"{name} · reference (cpu) · eager" in note
            assert "5 tokens" in note and "tok/s engine" in note and "TTFT" in note
        assert "greedy" in notes_[0] and "temperature 0.7, top-k 40" in notes_[1]
        for m in app.store.messages(app.chat.chat_id):
            if m.role == "assistant":
                assert m.stats["sampler"]["temperature"] in (0.0, 0.7)


@aio
async def test_every_action_is_in_the_command_palette(dirs, tiny_model_path):
    use_settings()
    seed_chat("old", [("user", "old question"), ("assistant", "old answer")])
    app = NanoqwenApp(model=tiny_model_path)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(app, pilot)
        titles = [c.title for c in app.get_system_commands(app.screen)]
        for _, _, short, _, _ in CHAT_ACTIONS:
            assert short in titles
        assert "Help" in titles
        assert app.chat.chat_id is not None
        # one real round trip through the palette
        await pilot.press("ctrl+p")
        await pilot.press(*"New chat")
        await pilot.pause(0.5)
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.chat.chat_id is None, 10, "the palette command")


@aio
async def test_help_lists_the_key_bindings(dirs, tiny_model_path):
    use_settings()
    app = NanoqwenApp(model=tiny_model_path)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(app, pilot)
        await pilot.press("f1")
        assert isinstance(app.screen, HelpScreen)
        h = app.screen
        rows = dict(zip([str(w.render()) for w in h.query(".help-key")],
                        [str(w.render()) for w in h.query(".help-desc")]))
        for key, _, _, desc, _ in CHAT_ACTIONS:
            assert rows.get(key) == desc, key
        assert "shift+enter, ctrl+j" in rows and "ctrl+p" in rows
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


@aio
async def test_a_message_too_long_for_the_context_is_refused_and_stays_to_edit(
        dirs, tiny_model_path):
    use_settings(max_new_tokens=5)
    app = NanoqwenApp(model=tiny_model_path)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(app, pilot)
        ctx = app.engine.info.max_context
        too_long = "word " * (ctx + 100)
        n = app.engine.count_tokens([{"role": "user", "content": too_long}])
        prompt = app.chat.query_one("#prompt", PromptInput)
        prompt.text = too_long
        await pilot.press("enter")
        refusals = lambda: [m for m in notes(app) if "tokens (chat template" in m]  # noqa: E731
        await wait_for(pilot, refusals, 10, "the refusal")
        [note] = refusals()
        # the numbers: its size, what fits (the context less the reply's reserve of 5)
        assert f"is {n} tokens" in note and f"at most {ctx - 5} fit" in note
        assert f"holds {ctx}" in note and "Shorten it" in note
        # nothing entered the chat, the store or the history; the text is still there to edit
        assert not app.chat.shown_messages(AssistantMessage) and not app.chat.shown_messages(UserMessage)
        assert app.chat.chat_id is None and not app.store.list_chats()
        assert prompt.text == too_long and not app.chat.generating
        perf = app.chat.perf
        assert perf.kv_len == 0                       # the gauge did not count it either
        # a conversation longer than the context (older turns left out) reads as full
        perf.set_context(ctx + 500)
        await pilot.pause()
        row = str(perf.query_one("#perf-context").content)
        assert f"{ctx} / {ctx} (100%)" in row and "older turns left out" in row
        # a message that fits goes as usual
        app.clear_notifications()
        widget = await send(app, pilot, "short")
        await reply_done(app, pilot)
        assert app.store.messages(app.chat.chat_id)[-1].finish == "length" and widget.source


@aio
async def test_engine_error_is_reported_kept_with_the_reply_and_the_app_stays_usable(
        dirs, tiny_model_path):
    """A real engine failure: the reply is regenerated after the chat's system prompt grew
    past the context (the message was checked when it was sent). The reason stays under the
    reply, also when the chat is reopened."""
    use_settings(max_new_tokens=5)
    app = NanoqwenApp(model=tiny_model_path)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(app, pilot)
        await send(app, pilot, "short")
        await reply_done(app, pilot)
        chat = app.chat.chat_id
        app.chat.edit_chat(chat, "short", "word " * (app.engine.info.max_context + 100))
        await app.chat.run_action("regenerate")
        await wait_for(pilot, lambda: not app.chat.generating and app.store.messages(
            app.chat.chat_id)[-1].finish == "error", 30, "the failed regenerate")
        await pilot.pause(0.05)
        assert any("does not fit the context" in n for n in notes(app))
        widget = app.chat.shown_messages(AssistantMessage)[-1]
        assert widget.border_subtitle.startswith("failed: The message does not fit the context")
        last = app.store.messages(app.chat.chat_id)[-1]
        assert last.stats["error"].startswith("The message does not fit the context")
        app.chat.open_chat(app.chat.chat_id)          # reopened: the reason is still there
        await pilot.pause(0.05)
        assert app.chat.shown_messages(AssistantMessage)[-1].border_subtitle == \
            widget.border_subtitle
        app.clear_notifications()
        await pilot.press("ctrl+n")     # a new chat: the settings' (empty) system prompt
        widget = await send(app, pilot, "short")
        await reply_done(app, pilot)
        assert app.store.messages(app.chat.chat_id)[-1].finish == "length"
        assert widget.source


def test_a_bad_thread_count_is_refused_before_the_app_starts():
    out = subprocess.run([sys.executable, "-m", "nanoqwen.app.main", "--threads", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--threads 0: give a whole number from 1 to" in out.stderr
    assert "Traceback" not in out.stderr


def test_console_script_help():
    out = subprocess.run([sys.executable, "-m", "nanoqwen.app.main", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for flag in ("--model", "--backend", "--mode", "Enter sends"):
        assert flag in out.stdout


@aio
async def test_the_app_shortens_the_gil_switch_interval_while_it_runs(dirs, tiny_model_path):
    """The generation worker's GIL hand-offs must not wait 5 ms behind each paint
    (main.GIL_SWITCH_INTERVAL says why); the process's own value comes back at exit."""
    from nanoqwen.app import main as app_main

    before = sys.getswitchinterval()
    app = NanoqwenApp(model=tiny_model_path)
    async with app.run_test(size=SIZE) as pilot:
        await loaded(app, pilot)
        assert sys.getswitchinterval() == pytest.approx(app_main.GIL_SWITCH_INTERVAL)
    assert sys.getswitchinterval() == before
