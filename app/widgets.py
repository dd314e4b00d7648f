"""Widgets of the chat screen: the prompt, the two kinds of message, copyable code blocks.

Code blocks are Textual's MarkdownFence (highlighted with Pygments the way textual.highlight
does it), subclassed to copy their code on click and to stream at a cost that does not grow
with the block. Textual's own fence highlights its whole code again in the constructor of the
block that every `Markdown.append` parses, and shows it as one Label, so every batch of a
streamed reply re-lexed and re-rendered the whole block: measured on the bundled model's
1500-token reply (one code block), 7.7 ms of UI-thread time per batch at the start, 37 ms at
the end. `CodeFence` instead
  * shows its code in chunks of CHUNK_LINES lines (one Label each): a batch changes only the
    last chunk, and the others keep their rendered lines;
  * lexes incrementally: Pygments' RegexLexer resumes from a state stack, so the lexer state
    recorded at a line start lets the next batch lex only from there (`_StreamHighlighter`);
  * highlights the whole block once more when the reply ends (`finalize`), so what stays on
    screen is exactly what a fresh render of the text shows.
A reply streams through `AssistantMessage.get_stream` (PacedMarkdownStream): at most
PAINT_INTERVAL between two appends, the first at once, because each append costs a screen
update however little text it brings; with an engine on the CPU, whose cores the UI paints
with, the appends are spaced so that the UI thread takes at most CPU_ENGINE_UI_SHARE of a
core. The message list's widgets lay out once per append, not twice (OnePassLayout).
"""

from __future__ import annotations

import asyncio
import time
from bisect import bisect_right

from pygments.lexer import RegexLexer
from pygments.lexers import get_lexer_by_name
from pygments.util import ClassNotFound
from markdown_it.token import Token
from textual import events
from textual.content import Content, Span
from textual.containers import VerticalScroll
from textual.message import Message
from textual.widgets import Label, Markdown, Static, TextArea
from textual.widgets._markdown import (MarkdownBlock, MarkdownFence, MarkdownParagraph,
                                      MarkdownStream)

ENTER_HINT = "Enter sends · Shift+Enter or Ctrl+J: new line"

# How a stored reply ended -> the note shown under it (None: nothing to say).
FINISH_NOTES = {
    None: "interrupted (the app closed while it streamed)",
    "cancelled": "stopped",
    "length": "reached the max new tokens",
    "context": "the context is full",
    "error": "failed",
    "stop": None,
}


class PromptInput(TextArea):
    """Multi-line prompt. Enter sends; Shift+Enter and Ctrl+J insert a newline (many
    terminals cannot tell Shift+Enter from Enter, Ctrl+J always arrives as its own key).
    Up on the first line and Down on the last walk through earlier prompts (as a shell
    does; the unsent draft comes back after the newest); PageUp/PageDown, and Home/End in
    an empty prompt, scroll the conversation (ScrollChat) instead of moving the cursor."""

    class Submitted(Message):
        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    class ScrollChat(Message):
        """Scroll the conversation: the key ("pageup", "pagedown", "home", "end")."""

        def __init__(self, key: str) -> None:
            super().__init__()
            self.key = key

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.prompts: list[str] = []     # earlier prompts, oldest first (Up recalls them)
        self._recall: int | None = None  # the history entry shown, None: the person's draft
        self._draft = ""

    def remember(self, text: str) -> None:
        """`text` was sent: the newest entry of the history; the draft starts afresh."""
        if text.strip() and (not self.prompts or self.prompts[-1] != text):
            self.prompts.append(text)
        self._recall, self._draft = None, ""

    def hold_cursor(self) -> None:
        """No cursor blink until `sent_shown`; the cursor stays as it is (showing or not:
        changing it would repaint the prompt now)."""
        self._pause_blink(visible=self._cursor_visible)

    def sent_shown(self, sent: str) -> None:
        """`sent` has been sent and its reply is on screen: take it out of the prompt. What
        was typed after it since Enter stays (the prompt empties late, ChatScreen._submitted);
        a prompt changed otherwise (an earlier prompt recalled, an edit) is left as it is.
        The cursor blinks again."""
        text = self.text
        if self._recall is None and text == sent:
            self.clear()
        elif self._recall is None and text.startswith(sent):
            self._show(text[len(sent):], at_end=True)
        if self.cursor_blink and self.has_focus:
            self._restart_blink()

    def _show(self, text: str, at_end: bool) -> None:
        self.text = text
        self.move_cursor(self.document.end if at_end else (0, 0))

    def _recall_key(self, key: str) -> bool:
        """Up on the first line goes to the previous prompt, Down on the last line to the
        next one and past the newest back to the draft; False when the key is not that."""
        row = self.cursor_location[0]
        if key == "up" and row == 0 and self.prompts:
            i = len(self.prompts) if self._recall is None else self._recall
            if i == 0:
                return True                      # the oldest: stay
            if self._recall is None:
                self._draft = self.text
            self._recall = i - 1
            self._show(self.prompts[i - 1], at_end=False)
            return True
        if key == "down" and self._recall is not None and row == self.document.line_count - 1:
            i = self._recall + 1
            self._recall = i if i < len(self.prompts) else None
            self._show(self.prompts[i] if i < len(self.prompts) else self._draft, at_end=True)
            return True
        return False

    async def _on_key(self, event: events.Key) -> None:
        # PageUp/PageDown scroll the conversation; Home/End too when there is nothing to edit
        if event.key in ("pageup", "pagedown") or (event.key in ("home", "end")
                                                   and not self.text):
            event.stop()
            event.prevent_default()
            self.post_message(self.ScrollChat(event.key))
            return
        if event.key in ("up", "down") and self._recall_key(event.key):
            event.stop()
            event.prevent_default()
            return
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            # to the screen at once, not bubbling up through each container's queue (one
            # task hop each, ~0.1 ms apiece between the key and the reply's start)
            self.screen.post_message(self.Submitted(self.text))
            return
        if event.key in ("shift+enter", "ctrl+j"):
            event.stop()
            event.prevent_default()
            if not self.read_only:
                start, end = self.selection
                self.replace("\n", start, end, maintain_selection_offset=False)
            return
        await super()._on_key(event)


class OnePassLayout:
    """Mixin for the widgets of the message list: a reflow that resizes them is not followed
    by a second, identical one.

    Textual's screen reflow gives each resized widget its new virtual size through a
    reactive declared layout=True, so every reflow that changes a size asks for another
    full reflow and repaint of the screen: each streamed append cost two layout frames
    (5-8 ms of UI-thread CPU each on a 2-core machine, measured with benchmarks/bench_app.py).
    The first reflow has already placed every widget at those sizes, anchored the list
    (the compositor scrolls an anchored container while it arranges it) and repainted them;
    a scrollbar that appears or goes asks for its own reflow (show_*_scrollbar are layout
    reactives). So these widgets take the new virtual size without asking for a layout.
    Relies on Widget._size_updated's `layout` flag (textual is pinned in pyproject.toml);
    tests/test_app_speed_invariants.py checks one reflow per append and the result."""

    def _size_updated(self, size, virtual_size, container_size, layout: bool = True) -> bool:
        # A widget that only grew or shrank keeps the lines its new height leaves as they were.
        # Textual drops all of a resized widget's rendered lines (Widget._set_dirty), so the
        # reply and its code block, which grow with every append, rendered all their lines
        # (border, padding, background: ~38 a frame) at every frame; with the width unchanged
        # and the content at the top, a line above the bottom gutter (padding + border) of the
        # shorter height is the same at either height (the styles cache renders a line from y,
        # the size and the styles only; a content change marks its own lines dirty). Measured on
        # the 2-core CPU (lab/ui_cpu_per_turn.py, replayed 512-token turns): the UI thread's
        # CPU a turn 10-17% lower, RESULTS.md session 17. tests/test_app.py compares the
        # screen with a render from empty caches.
        old = self._size   # type: ignore[attr-defined]
        cache = self._styles_cache   # type: ignore[attr-defined]
        keep = (size.width == old.width and old.height and size.height != old.height
                and self.styles.content_align_vertical == "top")  # type: ignore[attr-defined]
        if keep:
            lines, dirty = dict(cache._cache), set(cache._dirty_lines)
        resized = super()._size_updated(size, virtual_size, container_size,  # type: ignore[misc]
                                        layout=False)
        if keep:
            edge = self.styles.gutter.bottom   # type: ignore[attr-defined]
            y0 = max(0, min(old.height, size.height) - edge)
            cache._cache.update((y, strip) for y, strip in lines.items() if y < y0)
            cache._dirty_lines = dirty | set(range(y0, max(old.height, size.height)))
        return resized


class MessageList(OnePassLayout, VerticalScroll):
    """The chat's scrolling list of messages."""

    class AtTop(Message):
        """The wheel turned up with the list already at its top (earlier messages wait)."""

    def on_mouse_scroll_up(self, event: events.MouseScrollUp) -> None:
        if self.scroll_y <= 0:
            self.post_message(self.AtTop())


class EarlierMessages(OnePassLayout, Static):
    """First in the list when the chat's oldest messages are not mounted (chat.CHAT_WINDOW):
    how many, and how to show them. A click shows the next batch."""

    class Show(Message):
        pass

    def __init__(self, n: int) -> None:
        super().__init__(self.describe(n), classes="earlier")

    @staticmethod
    def describe(n: int) -> str:
        return (f"▲ {n} earlier message{'s' if n != 1 else ''}: page up or the wheel at the top "
                "shows them (ctrl+o, Chats, searches them all)")

    def set_count(self, n: int) -> None:
        self.update(self.describe(n))

    def on_click(self) -> None:
        self.post_message(self.Show())


class UserMessage(OnePassLayout, Static):
    def __init__(self, text: str, msg_id: int | None = None) -> None:
        super().__init__(text, markup=False, classes="message user")
        self.msg_id = msg_id
        self.border_title = "You"


CHUNK_LINES = 16          # lines per Label of a code block
# Least time between two appends of a streaming reply (PacedMarkdownStream): 15 a second
PAINT_INTERVAL = 1 / 15
# ... and the most, however costly the appends are (the stream still moves twice a second).
# Only an engine on the CPU is paced past PAINT_INTERVAL. At 0.25 s the cap, not the share,
# set the pace on the 2-core CI machine (an append and the frames until the next cost the UI
# 25-40 ms there: cost / share = 0.3-0.5 s), and the UI took 15-20% of a core instead of 8%;
# at 0.5 s, with the perf panel's CPU interval, a 256-token turn's UI-thread CPU fell from
# 571-577 to 347-348 ms (medians of 3, the turns replayed at 11 ms a step) and from 429-482 to
# 280-362 ms beside the real engine (benchmarks/RESULTS.md, session 14).
PAINT_INTERVAL_MAX = 0.5
# With an engine on the CPU, the share of one core the UI may take while a reply streams
# (PacedMarkdownStream.cpu_share). On a 2-core machine each ms the UI thread runs delays
# the 2-thread engine by about 1 ms (measured: 0.5-0.8 s of UI CPU per 256-token turn, the
# engine inside the app 0.5-0.7 s slower than alone; one busy thread stalls the other at
# every op's barrier), so this is about the turn's slowdown from painting.
CPU_ENGINE_UI_SHARE = 0.08
# Line breaks other than \n that textual.highlight normalises (str.splitlines), and tabs
# (expanded by the lexer): code holding any of them is highlighted whole, as Textual does.
_IRREGULAR = ("\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029",
              "\t", "\ufeff")


def _theme(ansi: bool, dark: bool):
    """The highlight theme class MarkdownFence.highlight picks."""
    if ansi:
        from textual.highlight import ANSIDarkHighlightTheme, ANSILightHighlightTheme

        return ANSIDarkHighlightTheme if dark else ANSILightHighlightTheme
    from textual.highlight import HighlightTheme

    return HighlightTheme


def _lexer(language: str):
    """The lexer textual.highlight uses for `language` (plain text if unknown)."""
    try:
        return get_lexer_by_name(language, stripnl=False, ensurenl=True, tabsize=8)
    except ClassNotFound:
        return get_lexer_by_name("text", stripnl=False, ensurenl=True, tabsize=8)


class _StreamHighlighter:
    """Highlight spans of a code block that grows at its end, as textual.highlight makes them.

    `update(code)` lexes code[done:] only. `done` is a resume point an earlier call found: a
    line start where a match of the lexer began with its state stack back at "root", at least
    one whole line before the end of that call's code. Lexing from there in "root" gives the
    tokens the whole code gives: only "root" points are taken because a rule that failed
    for want of text (Python's docstring rule before its closing quotes) falls back to rules
    that push a state, and the lexer stays out of "root" until that construct ends (a test
    checks this against the whole highlight, fragment by fragment, for several languages).
    The spans before `done` are kept. Lexers other than a plain RegexLexer, a language
    to guess, tabs and irregular line breaks: the whole code, each time (textual.highlight's
    own loop). `between(start, end)` gives the spans that overlap code[start:end].
    """

    def __init__(self, language: str, theme) -> None:
        self.language, self.theme = language, theme
        self.styles = theme.STYLES
        self.lexer = _lexer(language) if language else None
        self.resumable = (self.lexer is not None and not self.lexer.filters and
                          type(self.lexer).get_tokens_unprocessed
                          is RegexLexer.get_tokens_unprocessed)
        self.reset()

    def reset(self) -> None:
        self.code = ""                     # the code of the last update
        self.done = 0                      # code[:done] is lexed for good (a line start)
        self.kept: list[Span] = []         # spans of code[:done], in order
        self.kept_starts: list[int] = []
        self.tail: list[Span] = []         # spans of code[done:] as of the last update
        self.irregular = False

    def _span(self, ttype, start: int, end: int) -> Span | None:
        styles = self.styles
        while ttype is not None:
            if style := styles.get(ttype):
                return Span(start, end, style)
            ttype = ttype.parent
        return None

    def update(self, code: str) -> None:
        if not code.startswith(self.code[:self.done]):
            self.reset()
        new = code[len(self.code):] if code.startswith(self.code) else code
        self.irregular = self.irregular or any(c in new for c in _IRREGULAR)
        self.code = code
        if not self.resumable or self.irregular:
            self._whole(code)
            return
        base = self.done
        tail = code[base:]
        if not tail.endswith("\n"):
            tail += "\n"                  # the lexer's ensurenl
        last_nl = code.rfind("\n")
        limit = code.rfind("\n", 0, last_nl) + 1 if last_nl > 0 else 0  # second-last line
        gen = self.lexer.get_tokens_unprocessed(tail)   # from "root", as at every resume point
        spans: list[Span] = []
        resume = None                      # (offset, stack, spans before it)
        line_start = True
        for index, ttype, value in gen:
            pos = base + index
            if line_start and base < pos <= limit:
                local = gen.gi_frame.f_locals  # the lexer's loop, suspended at this match
                if local.get("pos") == index and local.get("statestack") == ["root"]:
                    resume = (pos, len(spans))
            if span := self._span(ttype, pos, pos + len(value)):
                spans.append(span)
            line_start = value.endswith("\n")
        if resume is not None:
            pos, n = resume
            self.kept.extend(spans[:n])
            self.kept_starts.extend(sp.start for sp in spans[:n])
            self.done, spans = pos, spans[n:]
        self.tail = spans

    def _whole(self, code: str) -> None:
        from textual.highlight import guess_language

        lexer = self.lexer if self.lexer is not None else _lexer(guess_language(code, None))
        spans, start = [], 0
        for ttype, token in lexer.get_tokens("\n".join(code.splitlines())):
            end = start + len(token)
            if span := self._span(ttype, start, end):
                spans.append(span)
            start = end
        self.done, self.kept, self.kept_starts, self.tail = 0, [], [], spans

    def between(self, start: int, end: int) -> list[Span]:
        out = []
        # kept spans do not overlap each other, so only the one before `start` can reach in
        i = max(bisect_right(self.kept_starts, start) - 1, 0)
        for spans, j in ((self.kept, i), (self.tail, 0)):
            for k in range(j, len(spans)):
                sp = spans[k]
                if sp.start >= end:
                    break
                if sp.end > start:
                    out.append(sp)
        return out


class CodeChunk(OnePassLayout, Label):
    """CHUNK_LINES lines of a code block."""


class CodeFence(OnePassLayout, MarkdownFence):
    """A highlighted code block, shown in chunks of lines and highlighted incrementally while
    it streams (module doc); a click copies its code to the clipboard."""

    # framed, with the language on the frame and how to copy it under the block
    DEFAULT_CSS = """
    CodeFence { padding: 0 0; border: round $foreground 25%; border-title-align: left;
                border-subtitle-align: right; border-title-color: $text-muted;
                border-subtitle-color: $text-muted; }
    CodeFence.-copied { border: round $accent; }
    CodeFence > .code-chunk { padding: 0 1; }
    CodeFence:ansi { padding: 0 0; }
    CodeFence:ansi > .code-chunk { padding: 0 0; }
    """
    COPY_HINT = "click or F2: copy"

    def __init__(self, markdown: Markdown, token, code: str) -> None:
        # MarkdownFence.__init__ would highlight the whole code here, for every block that
        # Markdown.append parses; it is highlighted when shown instead.
        MarkdownBlock.__init__(self, markdown, token)
        self.code = code
        self.lexer = token.info
        self.auto_links = False
        self._hl: _StreamHighlighter | None = None
        self._chunks: list[CodeChunk] = []
        self._shown: list[tuple] = []      # per chunk: (text, spans) on screen
        self._sealed = 0                   # chunks that can no longer change ...
        self._sealed_end = 0               # ... and where the first other one starts
        self._label()

    def _label(self) -> None:
        """The language on the frame (the fence's info string; "code" without one)."""
        self.border_title = (self.lexer or "").split()[0] if (self.lexer or "").strip() \
            else "code"
        self.border_subtitle = self.COPY_HINT
    # --- highlighting --------------------------------------------------------------------
    def _highlighter(self) -> _StreamHighlighter:
        theme = _theme(self.app.native_ansi_color, self.app.current_theme.dark)
        hl = self._hl
        if hl is None or hl.language != self.lexer or hl.theme is not theme:
            self._hl = hl = _StreamHighlighter(self.lexer, theme)
            self._sealed = self._sealed_end = 0
        return hl

    def _render_chunks(self, code: str) -> list[CodeChunk]:
        """Bring the chunks up to `code`: update those that changed, drop those past its end;
        return the new ones, to be mounted."""
        hl = self._highlighter()
        if not code.startswith(hl.code[:self._sealed_end]):
            self._sealed = self._sealed_end = 0
        hl.update(code)
        # only the chunks from the first unsealed one on: the work does not grow with the code
        lines = code[self._sealed_end:].split("\n")
        n = (len(lines) + CHUNK_LINES - 1) // CHUNK_LINES
        offset, new = self._sealed_end, []
        for j in range(n):
            k = self._sealed + j
            text = "\n".join(lines[j * CHUNK_LINES:(j + 1) * CHUNK_LINES])
            start, end = offset, offset + len(text)
            offset = end + 1
            key = (text, tuple(Span(max(sp.start, start) - start, min(sp.end, end) - start,
                                    sp.style) for sp in hl.between(start, end)))
            if k < len(self._chunks):
                if self._shown[k] != key:
                    self._shown[k] = key
                    self._chunks[k].update(self._chunk_content(key))
            else:
                chunk = CodeChunk(self._chunk_content(key), expand=True, classes="code-chunk")
                self._chunks.append(chunk)
                self._shown.append(key)
                new.append(chunk)
        total = self._sealed + n
        for chunk in self._chunks[total:]:
            chunk.remove()
        del self._chunks[total:], self._shown[total:]
        # a chunk before the last one, ending before the spans kept for good, is final
        start = self._sealed_end
        for j in range(n - 1):
            end = start + len(self._shown[self._sealed][0]) + 1
            if end > hl.done:
                break
            self._sealed, self._sealed_end, start = self._sealed + 1, end, end
        return new

    @staticmethod
    def _chunk_content(key) -> Content:
        text, spans = key
        return Content(text, spans=list(spans)).stylize_before("$text")

    def _refresh_chunks(self) -> None:
        if self.is_mounted:
            new = self._render_chunks(self.code)
            if new:
                self.mount_all(new)

    def finalize(self) -> None:
        """Highlight the whole block once more (the reply has ended): what stays on screen is
        then exactly a fresh render's, whatever the batches were."""
        self._hl = None
        self._refresh_chunks()

    # --- MarkdownFence's hooks -----------------------------------------------------------
    def compose(self):
        yield from self._render_chunks(self.code)

    def notify_style_update(self) -> None:
        # Textual's fence re-highlights here on every style change; only a new theme needs it
        # (_highlighter starts over when the theme differs)
        MarkdownBlock.notify_style_update(self)
        if self._chunks:
            hl = self._hl
            if hl is None or hl.theme is not _theme(self.app.native_ansi_color,
                                                     self.app.current_theme.dark):
                self._refresh_chunks()

    def _copy_context(self, block: MarkdownBlock) -> None:
        if isinstance(block, MarkdownFence):
            self.code = block.code
            if block.lexer != self.lexer:
                self.lexer = block.lexer
                self._label()
        MarkdownBlock._copy_context(self, block)

    async def _update_from_block(self, block: MarkdownBlock) -> None:
        if isinstance(block, MarkdownFence):
            self._copy_context(block)
            new = self._render_chunks(self.code)
            if new:
                await self.mount_all(new)
        else:
            await super()._update_from_block(block)

    def set_content(self, content: Content) -> None:
        """MarkdownFence's setter: show `content`'s text, highlighted here."""
        self.code = content.plain
        self._refresh_chunks()

    def on_click(self, event: events.Click) -> None:
        event.stop()
        self.app.copy_code(self.code)  # type: ignore[attr-defined]


class PacedMarkdownStream(MarkdownStream):
    """Textual's MarkdownStream, appending at most once per PAINT_INTERVAL, and with
    `cpu_share` set, no more often than keeps the UI thread's CPU time under that share.

    Every append costs the UI thread a screen update whatever the amount of new text
    (measured on this 2-core CPU before OnePassLayout: two layout frames of 5-8 ms each, one
    since, plus the parse and mount, 13-20 ms of UI-thread CPU per append), and
    with the engine on the CPU the UI's time is the engine's (CPU_ENGINE_UI_SHARE). So the
    stream measures the UI thread's CPU time (time.thread_time: the stream runs on the
    event loop, in the UI thread) from one append to the next, everything the UI did in
    between included, and waits long enough that this cost is at most `cpu_share` of the
    wall time: interval = cost / cpu_share, between PAINT_INTERVAL and PAINT_INTERVAL_MAX.
    A faster machine or a cheaper screen gets more appends, a costly one fewer. The first
    text still goes out at once; what arrives within the interval waits in the stream and
    goes out joined with the next. `stop()` returns once every written fragment is in the
    widget.
    """

    def __init__(self, markdown_widget: Markdown, cpu_share: float | None = None) -> None:
        super().__init__(markdown_widget)
        self.cpu_share = cpu_share
        self.interval = PAINT_INTERVAL     # the wait before the next append
        self._next = 0.0
        self._cpu: float | None = None     # the UI thread's CPU time at the last append
        self._inflight: asyncio.Future | None = None
        self.first_append = asyncio.Event()   # set once the first text is in the widget

    def _pace(self) -> None:
        now, cpu = time.monotonic(), time.thread_time()
        if self.cpu_share and self._cpu is not None:
            cost = cpu - self._cpu            # UI-thread CPU since the last append began
            self.interval = min(max(cost / self.cpu_share, PAINT_INTERVAL), PAINT_INTERVAL_MAX)
        self._cpu = cpu
        self._next = now + self.interval

    async def _run(self) -> None:
        try:
            while await self._new_markup.wait():
                wait = self._next - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                new_markdown = "".join(self._pending)
                self._pending.clear()
                self._new_markup.clear()
                self._pace()
                self._inflight = asyncio.ensure_future(self.markdown_widget.append(new_markdown))
                await asyncio.shield(self._inflight)
                self.first_append.set()
        except asyncio.CancelledError:
            pass
        if self._inflight is not None:
            await self._inflight   # the append a cancel interrupted goes first
        new_markdown = "".join(self._pending)
        self._pending.clear()
        if new_markdown:
            await self.markdown_widget.append(new_markdown)
        self.first_append.set()   # or there was none: nobody waits for it any more


def _one_pass(block: type) -> type:
    """`block` (a Markdown block class) with OnePassLayout; same name, so CSS matches it."""
    return type(block.__name__, (OnePassLayout, block), {})


_PARSER: list = []


def _markdown_parser():
    """One MarkdownIt for every reply: Markdown builds a new parser for every append
    otherwise (0.2 ms each on the 2-core CPU; the parse of a streamed fragment takes less).
    Parsing is synchronous and on the UI thread, so one instance is never used twice at once."""
    if not _PARSER:
        from markdown_it import MarkdownIt
        _PARSER.append(MarkdownIt("gfm-like"))
    return _PARSER[0]


class _SameHeightUpdate:
    """Mixin for MarkdownParagraph: an update in place (Markdown.append streaming into the
    reply's last paragraph) that leaves the paragraph as many lines high as it was asks for
    a repaint of the paragraph, not a reflow of the screen. Static.update asks for a layout
    every time; most appends of a streamed reply only extend the paragraph's last line, and
    the reply's first text fills the one line of the empty paragraph it streams into
    (AssistantMessage.open_block), so its frame renders that line and nothing moves.
    tests/test_app_speed_invariants.py checks both cases against a fresh render."""

    def set_content(self, content: Content) -> None:
        width, height = self.content_size                    # type: ignore[attr-defined]
        styles = self.styles                                 # type: ignore[attr-defined]
        same = (width > 0 and height > 0 and self.is_mounted  # type: ignore[attr-defined]
                and styles.width is not None and not styles.width.is_auto
                and content.get_height(styles, width) == height)
        self._content = content
        self.update(content, layout=not same)                # type: ignore[attr-defined]


class AssistantMessage(OnePassLayout, Markdown):
    """A reply, rendered as Markdown. Streaming goes through `AssistantMessage.get_stream`."""

    BLOCKS = {**{name: _one_pass(block) for name, block in Markdown.BLOCKS.items()},
              "paragraph_open": type(MarkdownParagraph.__name__,
                                     (_SameHeightUpdate, OnePassLayout, MarkdownParagraph), {}),
              "fence": CodeFence, "code_block": CodeFence}

    def __init__(self, text: str = "", msg_id: int | None = None,
                 finish: str | None = "stop", error: str | None = None,
                 streaming: bool = False) -> None:
        # the class given here, not added by set_finish: adding one restyles the widget
        super().__init__(text, classes="message assistant" + (" -streaming" * streaming),
                         open_links=False, parser_factory=_markdown_parser)
        self.msg_id = msg_id
        self.border_title = "Assistant"
        self.set_finish(finish, streaming=streaming, error=error)

    async def open_block(self) -> None:
        """Mount an empty paragraph to stream into, once the reply is mounted: the first
        append then sets that block's content (Markdown.append updates the last block in
        place when the new text starts with one of its kind) instead of mounting a block,
        so the first text after the engine's first token skips a mount and its layout
        (measured 4-11 ms on the H200's host). Its mount happens while the engine prefills.
        A reply that starts with some other block replaces it, as before."""
        if not self.query(MarkdownBlock):
            await self.mount(self.BLOCKS["paragraph_open"](
                self, Token("paragraph_open", "p", 1, map=[0, 1])))

    @classmethod
    def get_stream(cls, markdown: Markdown,
                   cpu_share: float | None = None) -> PacedMarkdownStream:
        """Markdown.get_stream, paced (PacedMarkdownStream; `cpu_share`: its UI CPU limit)."""
        stream = PacedMarkdownStream(markdown, cpu_share)
        stream.start()
        return stream

    def set_finish(self, finish: str | None, streaming: bool = False,
                   error: str | None = None) -> None:
        """The note under the reply: how it ended (a failure with its reason, `error`), or
        that it is still streaming."""
        if streaming:
            self.border_subtitle = "streaming… (esc stops)"
        else:
            note = FINISH_NOTES.get(finish, finish)
            if finish == "error" and error:
                note = f"{note}: {error.splitlines()[0]}"
            self.border_subtitle = note or ""
            if self.is_mounted:
                for fence in self.query(CodeFence):
                    fence.finalize()
        self.set_class(streaming, "-streaming")
