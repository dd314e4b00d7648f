"""The chat screen: message list, prompt, perf panel; one reply streaming at a time.

A reply's life: `send` stores the user message, asks the engine service for the reply
(`submit`, in the UI thread: it only builds the iterator, so an Esc that comes before the
thread starts is not lost) and iterates it in a thread of its own, started at once; then it
stores an empty assistant row and shows the turn's two widgets while the engine prefills:
they were mounted, empty and hidden, while nobody waited (_prepare_next), the reply with an
empty paragraph for the first text to fill in place (AssistantMessage.open_block), and
their frame is made while the engine prefills; the first text's frame is made as soon as it
is in (_FirstFrame), and the perf panel, the title and the prompt (which keeps the sent
text until then) change after it. The service sends at most one event per ~40 ms window
(text + the engine's timings); the worker forwards each with `post_message`;
`on_reply_event` writes the text to the store *before* handing it to the Markdown stream, so
whatever is on screen is already on disk, and then tells the perf panel when that text
reached the screen. Esc cancels through the service; the partial reply stays, marked
"stopped".

The message list is anchored to its end (Textual's `anchor()`): it follows the stream until
the user scrolls up, and follows again once they scroll back down.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import threading
import time
from collections.abc import Iterator
from functools import partial
from dataclasses import dataclass
from pathlib import Path

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, Header, Label, ProgressBar
from textual.widgets._markdown import MarkdownBlock

from nanoqwen.engine.service import Batch, Failed, Finished, Note, ServiceEvent

from . import heap
from .perf import ModelInfo, PerfPanel
from .settings import PERF_PANEL
from .screens import ChatsScreen, ExportScreen
from .widgets import (CPU_ENGINE_UI_SHARE, ENTER_HINT, AssistantMessage, CodeFence,
                      EarlierMessages, MessageList, PromptInput, UserMessage)

# (binding, description in help/palette); the same list builds BINDINGS, the help screen
# and the command palette, so none can drift from the others.
CHAT_ACTIONS = [
    ("escape", "stop", "Stop", "Stop the reply (the partial reply is kept)", True),
    ("ctrl+r", "regenerate", "Regenerate", "Regenerate the last reply", True),
    ("ctrl+n", "new_chat", "New chat", "Start a new chat", True),
    ("ctrl+o", "past_chats", "Chats", "Open a past chat", True),
    ("f2", "copy_code", "Copy code",
     "Copy the last code block; again: the one before (or click a block)", True),
    ("ctrl+t", "export", "Export", "Export the chat to a Markdown file", False),
    ("ctrl+g", "toggle_mode", "Graph/eager", "Toggle CUDA-graph / eager decode", True),
    ("f3", "perf_panel", "Perf panel",
     "Perf panel: beside the chat, one line under it, or hidden", True),
    ("ctrl+s", "settings", "Settings", "Sampler, max tokens, system prompt, decode mode", True),
    ("ctrl+l", "open_model", "Model", "Open another model file", False),
]


# The perf panel's width beside the chat (chat.tcss) and the columns the conversation keeps:
# a terminal narrower than both folds the panel to its one line (fit_panel).
PANEL_WIDTH = 36
CHAT_MIN_COLUMNS = 40

COPY_CYCLE_S = 5.0   # a second F2 within this many seconds copies the block before

# The most messages the list mounts: older ones wait behind an EarlierMessages note and come
# EARLIER_BATCH at a time (page up, the wheel at the top, a click on the note). Every new
# message (and every block a streamed reply mounts) makes Textual reflow the whole screen,
# every widget of every mounted message. Measured on the 2-core CPU with no engine work (a
# message mounted, the frame after it; session 9, RESULTS.md): 20-25 ms with 10 exchanges
# (252 widgets), 36-44 ms with 40 (882), so ~0.6 ms more per exchange, without end; with the
# window, 40 exchanges cost what 10 do (16-24 ms). A reply's end trims a list grown past
# CHAT_WINDOW + EARLIER_BATCH back to CHAT_WINDOW when the person is at the bottom.
CHAT_WINDOW = 20
EARLIER_BATCH = 20

# From Enter until the reply's first text's frame, or this many seconds: no garbage
# collection (heap.py), and what changes outside the message column (the perf panel, the
# title, the prompt's emptying) waits (_FirstFrame). The deadline lets them go when no
# text comes (a long prompt's prefill); the bundled model's first text comes 35-60 ms
# after Enter on a 2-core CPU.
FIRST_TEXT_WAIT = 0.25


def _frame_now(app) -> None:
    """Make the screen's pending frame now instead of at the next tick of its update timer.
    Textual (8.2.8, pinned) makes at most one frame per 1/60 s on a fixed grid: a refresh
    waits up to 16.7 ms for the tick. The tick's own handler does the update, and pausing the
    timer first is what it does too; it skips the frame while a batch is open or the screen
    is not the current one."""
    screen = app.screen
    if not app._batch_count and screen.is_current:
        screen._on_timer_update()


class _FirstFrame:
    """The first text's frame, made as soon as the text is in its widget (_frame_now), not
    at the next tick; callbacks `after` it; no garbage collection until then.

    The new messages are not held back: their frame is made while the engine prefills
    (a reflow of the column, 7-17 ms on the H200's host), and the first text then fills the
    reply's empty paragraph on its line without a reflow (widgets._SameHeightUpdate), so its
    frame repaints that region alone (1-3 ms there). Measured on the H200 against holding
    every frame until the first text (that frame then reflowed and rendered the whole
    column, after the slot): Enter -> text 26.9 -> 20.3 ms (new chat, graph), 30.9 -> 23.4
    (next turn); benchmarks/RESULTS.md, session 12.

    `after`: callbacks run once the frame after the first text has been made, or after
    FIRST_TEXT_WAIT when no text has come by then (its frame is still made at once). The
    chat puts there what changes outside the message column (the perf panel, the header's
    title, the prompt's emptying: ChatScreen._submitted): a frame renders the screen region
    bounding everything that changed, so the first text's frame then renders the column
    alone (measured: the whole screen otherwise, most of that frame's time)."""

    def __init__(self, app, stream, after=()) -> None:
        self._app = app
        # no garbage collection until the frame is out (heap.py), then the caller's callbacks
        self._after = list(after) + [partial(heap.resume, heap.pause())]
        self._pending = True
        self._timer = app.set_timer(FIRST_TEXT_WAIT, self.release, name="first-text-wait")
        self._task = asyncio.ensure_future(self._until_text(stream))

    async def _until_text(self, stream) -> None:
        await stream.first_append.wait()   # also set when the stream ends without text
        _frame_now(self._app)
        self.release()

    def release(self) -> None:
        if self._pending:
            self._pending = False
            self._timer.stop()
            for callback in self._after:
                self._app.call_after_refresh(callback)


def _title(text: str) -> str:
    line = text.strip().splitlines()[0] if text.strip() else "chat"
    return line[:60] + ("…" if len(line) > 60 else "")


def too_long(n: int, room: int, max_context: int, system: bool) -> str:
    """Why a message is refused, with the numbers and what would help."""
    what = "The system prompt and this message are" if system else "This message is"
    return (f"{what} {n} tokens (chat template included); at most {room} fit: the context "
            f"holds {max_context} and {max_context - room} are kept for the reply. Shorten it or "
            "send it in parts" + (", or shorten the system prompt (Settings)." if system else "."))


class ReplyEvent(Message):
    """An engine service event for reply `gen_id`, posted from the generation worker."""

    def __init__(self, gen_id: int, event: ServiceEvent) -> None:
        super().__init__()
        self.gen_id = gen_id
        self.event = event


@dataclass
class _Streaming:
    gen_id: int
    msg_id: int
    widget: AssistantMessage
    stream: object          # textual MarkdownStream
    made: dict              # model, backend, device, sampler: stored with the figures
    text: str = ""
    batches: int = 0        # text batches that reached the screen (one per ~40 ms)


class ChatScreen(Screen):
    CSS_PATH = "chat.tcss"
    BINDINGS = [Binding(key, action, short, show=show)
                for key, action, short, _, show in CHAT_ACTIONS]
    # The UI clock for what the person sees (Enter, text on screen); replaceable in tests.
    clock = staticmethod(time.perf_counter)

    def __init__(self) -> None:
        super().__init__()
        self.chat_id: int | None = None
        self.chat_system: str | None = None        # the open chat's own system prompt
        self.reply: _Streaming | None = None       # the reply streaming now
        self.last_reply: _Streaming | None = None  # the latest one, streaming or not
        self._gen = 0
        self._earlier = 0   # the open chat's oldest messages not mounted (CHAT_WINDOW)
        self._showing = False   # show_earlier is mounting a batch
        self._copied = (float("-inf"), 0, 0)   # (when, which block, of how many): F2 cycles
        self._next: tuple[UserMessage, AssistantMessage] | None = None   # _prepare_next

    # --- layout ------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            with Vertical(id="chat-col"):
                with Vertical(id="loading"):
                    yield Label("", id="loading-label")
                    yield ProgressBar(id="loading-bar", show_eta=False)
                yield MessageList(id="messages")
                yield PromptInput(id="prompt", placeholder=f"Message…  ({ENTER_HINT})",
                                  show_line_numbers=False, compact=True)
            yield PerfPanel(freeze_timing=self.app.freeze_perf, id="perf")
        yield Footer()

    def on_mount(self) -> None:
        self.app.chat = self
        self.query_one("#messages").anchor()
        self.query_one("#prompt").focus()
        self.fit_panel()
        latest = self.app.store.latest_chat()
        if latest is not None:
            self.open_chat(latest)
        else:
            self.call_after_refresh(self._prepare_next)
        self.app.chat_ready()

    @property
    def perf(self) -> PerfPanel:
        return self.query_one("#perf", PerfPanel)

    @property
    def generating(self) -> bool:
        return self.reply is not None

    # --- model loading (driven by the app) ------------------------------------------------
    def show_loading(self, path: Path) -> None:
        self.query_one("#loading-label", Label).update(f"Loading {path} …")
        self.query_one("#loading-bar", ProgressBar).update(total=None, progress=0)
        self.query_one("#loading").add_class("-active")

    def load_progress(self, done: int, total: int, what: str) -> None:
        self.query_one("#loading-bar", ProgressBar).update(total=max(total, 1), progress=done)
        if what:
            self.query_one("#loading-label", Label).update(f"Loading … {what}")

    def hide_loading(self) -> None:
        self.query_one("#loading").remove_class("-active")

    def model_ready(self, info: ModelInfo) -> None:
        self.hide_loading()
        self.perf.set_model(info)
        self.sub_title = f"{info.model} · {info.backend}"
        self._update_context()

    # --- chats ---------------------------------------------------------------------------
    def _history(self, stored: list | None = None) -> list[dict]:
        """The chat as the engine takes it; `stored`: its messages already read from the store."""
        if stored is None:
            if self.chat_id is None:
                return []
            stored = self.app.store.messages(self.chat_id)
        return [{"role": m.role, "content": m.content} for m in stored if m.role != "system"]

    def _update_context(self, history: list[dict] | None = None) -> None:
        engine = self.app.engine
        if engine is None:
            return
        try:
            if history is None:
                history = self._history()
            n = engine.count_tokens(history, self.system_prompt)
        except Exception:  # noqa: BLE001 - a gauge must never take the screen down
            return
        self.perf.set_context(n)

    @property
    def system_prompt(self) -> str:
        """The open chat's system prompt; a chat not started yet (or one from before chats
        had their own) takes the settings' prompt for new chats."""
        if self.chat_id is not None and self.chat_system is not None:
            return self.chat_system
        return self.app.settings.system_prompt

    def edit_chat(self, chat_id: int, title: str, system_prompt: str) -> None:
        """Rename a stored chat and set its system prompt (the Chats screen's edit); the
        open chat's next reply uses the new prompt."""
        store = self.app.store
        store.set_title(chat_id, title)
        store.set_system_prompt(chat_id, system_prompt)
        if chat_id == self.chat_id:
            self.chat_system = system_prompt
            self.app.title = f"nanoqwen-chat — {title}"
            self._update_context()

    async def _collect_after(self, removal) -> None:
        """The old chat's widgets are garbage once removed: collect them while the person
        reads or types, not at their next Enter (heap.py)."""
        await removal
        heap.collect_soon(self.app)

    @staticmethod
    def _listed(stored) -> list:
        """The stored messages the list shows, in order (the window's indices count these)."""
        return [m for m in stored if m.role in ("user", "assistant")]

    @staticmethod
    def _message_widgets(listed) -> list:
        return [UserMessage(m.content, m.id) if m.role == "user" else
                AssistantMessage(m.content, m.id, m.finish, (m.stats or {}).get("error"))
                for m in listed]

    def _mounted_messages(self) -> list:
        """The messages on the list, oldest first (not the hidden next turn's two)."""
        hidden = self._next or ()
        return [w for w in self.query_one("#messages").query_children(".message")
                if w not in hidden]

    def shown_messages(self, kind: type | None = None) -> list:
        """The mounted messages (of `kind`, UserMessage or AssistantMessage), oldest first."""
        return [w for w in self._mounted_messages() if kind is None or isinstance(w, kind)]

    async def _prepare_next(self) -> None:
        """Mount the next turn's user message and reply, empty and hidden, at the end of the
        list, while nobody waits (after a chat opens, after a reply ends): Enter then fills
        and shows them (_start_reply) instead of mounting two messages and the reply's first
        paragraph, which on the H200's host took 6.5-12 ms of the UI thread after Enter
        while the engine prefilled, and delayed the worker's post of the first text (it
        waits for the GIL) by 2-5 ms more."""
        if self._next is not None or self.generating or not self.is_mounted:
            return
        user = UserMessage("", None)
        reply = AssistantMessage("", None, finish=None, streaming=True)
        for w in (user, reply):
            w.display = False
        self._next = (user, reply)
        box = self.query_one("#messages", VerticalScroll)
        await box.mount_all([user, reply])
        await reply.open_block()

    def _take_next(self) -> tuple[UserMessage, AssistantMessage] | None:
        """The hidden next turn, if it is mounted and still last on the list; else None
        (the caller mounts new widgets)."""
        pair, self._next = self._next, None
        if pair is None:
            return None
        children = list(self.query_one("#messages").children)
        if (children[-2:] != list(pair) or not all(w.is_mounted for w in pair)
                or not pair[1].query(MarkdownBlock)):
            for w in pair:
                w.remove()
            return None
        return pair

    def _set_earlier(self, n: int) -> None:
        """The note over the list says `n` messages are not mounted (none: no note)."""
        self._earlier = n
        box = self.query_one("#messages", VerticalScroll)
        notes = box.query_children(EarlierMessages)
        if n and notes:
            notes.first().set_count(n)
        elif n:
            box.mount(EarlierMessages(n), before=0)
        else:
            notes.remove()

    async def show_earlier(self) -> None:
        """Mount the EARLIER_BATCH messages before the first one mounted, the view kept on
        what it showed."""
        if not self._earlier or self.chat_id is None or self._showing:
            return   # (a key repeated while a batch mounts must not mount it twice)
        self._showing = True
        try:
            await self._mount_earlier()
        finally:
            self._showing = False

    async def _mount_earlier(self) -> None:
        stored = self._listed(self.app.store.messages(self.chat_id))
        end = self._earlier
        start = max(0, end - EARLIER_BATCH)
        box = self.query_one("#messages", VerticalScroll)
        mounted = self._mounted_messages()
        widgets = self._message_widgets(stored[start:end])
        if mounted:
            await box.mount_all(widgets, before=mounted[0])
        else:
            await box.mount_all(widgets)
        self._set_earlier(start)
        if mounted:   # what was at the top stays there
            self.call_after_refresh(box.scroll_to_widget, mounted[0], animate=False, top=True)

    @on(MessageList.AtTop)
    @on(EarlierMessages.Show)
    async def _show_earlier(self, event) -> None:
        event.stop()
        await self.show_earlier()

    def _trim(self) -> None:
        """A list grown past CHAT_WINDOW + EARLIER_BATCH during the chat goes back to the
        newest CHAT_WINDOW messages, when the person is at the bottom (not reading old ones)."""
        box = self.query_one("#messages", VerticalScroll)
        mounted = self._mounted_messages()
        excess = len(mounted) - CHAT_WINDOW
        if len(mounted) <= CHAT_WINDOW + EARLIER_BATCH or box.scroll_y < box.max_scroll_y - 1:
            return
        for w in mounted[:excess]:
            w.remove()
        self._set_earlier(self._earlier + excess)

    def open_chat(self, chat_id: int | None) -> None:
        """Show a stored chat (None: an empty new chat), its newest CHAT_WINDOW messages."""
        box = self.query_one("#messages", VerticalScroll)
        self.call_later(self._collect_after, box.remove_children())
        self._next = None   # removed with the rest
        self.chat_id = chat_id
        self._earlier = 0
        about = self.app.store.chat(chat_id) if chat_id is not None else None
        self.chat_system = about.system_prompt if about else None
        stored = self.app.store.messages(chat_id) if chat_id is not None else []
        if chat_id is not None:
            shown = self._listed(stored)
            start = max(0, len(shown) - CHAT_WINDOW)
            self._earlier = start
            box.mount_all(([EarlierMessages(start)] if start else [])
                          + self._message_widgets(shown[start:]))
            self.app.title = f"nanoqwen-chat — {self.app.store.chat_title(chat_id)}"
        else:
            self.app.title = "nanoqwen-chat"
        box.scroll_end(animate=False)
        prompt = self.query_one("#prompt", PromptInput)
        prompt.prompts = [m.content for m in stored if m.role == "user"]   # Up recalls them
        prompt.remember("")
        self._update_context(self._history(stored))  # the rows just read, not a second query
        self.call_after_refresh(self._prepare_next)   # after the chat's own frame

    # --- sending -------------------------------------------------------------------------
    @on(PromptInput.Submitted)
    async def _submitted(self, event: PromptInput.Submitted) -> None:
        prompt = self.query_one("#prompt", PromptInput)
        # The prompt empties once the reply's first text is on screen (or FIRST_TEXT_WAIT has
        # passed), not at Enter: the frame that shows the new messages, which the first
        # text waits for, then leaves the prompt alone, and the region it renders ends at
        # the new messages instead of spanning down to the prompt. Measured on the H200:
        # that frame 10.5 -> 7 ms, Enter -> text 16.7 -> 12.8 ms (new chat), 23.0 -> 18.7
        # (next turn); RESULTS.md, session 13. The cursor holds still until then (a blink
        # repaints the prompt, and a frame renders the region bounding all it repaints).
        if await self.send(event.text, after=[partial(prompt.sent_shown, event.text)]):
            prompt.remember(event.text)
            prompt.hold_cursor()

    @on(PromptInput.ScrollChat)
    def _scroll_chat(self, event: PromptInput.ScrollChat) -> None:
        box = self.query_one("#messages", VerticalScroll)
        if event.key in ("pageup", "home") and box.scroll_y <= 0 and self._earlier:
            self.call_later(self.show_earlier)   # at the top already: the earlier messages
            return
        {"pageup": box.scroll_page_up, "pagedown": box.scroll_page_down,
         "home": box.scroll_home, "end": box.scroll_end}[event.key](animate=False)

    async def send(self, text: str, after=()) -> bool:
        """Send a user message; False (with a notification) if it cannot go now. `after`:
        callbacks run once the reply's first text is on screen (_FirstFrame)."""
        t0 = self.clock()   # Enter: where the TTFT the person sees starts
        app = self.app
        if not text.strip():
            return False
        if app.engine is None:
            self.notify("No model is loaded: ctrl+l opens one", severity="warning")
            return False
        if self.generating:
            self.notify("A reply is still streaming: esc stops it", severity="warning")
            return False
        s = app.settings
        system = self.system_prompt
        n, room = app.engine.message_room(text, system, s.max_new_tokens)
        if n > room:   # refused before it enters the chat: it stays in the prompt to edit
            self.notify(too_long(n, room, app.engine.info.max_context, bool(system)),
                        title="Message too long", severity="error", timeout=20)
            return False
        store = app.store
        if self.chat_id is None:
            # the chat keeps the system prompt it starts with (the settings' is for new chats)
            self.chat_id = store.new_chat(_title(text), app.engine.info.name, system)
            self.chat_system = system
            title = f"nanoqwen-chat — {_title(text)}"
        else:
            title = None
        history = self._history()
        msg_id = store.add_message(self.chat_id, "user", text)
        await self._start_reply(history, text, t0, (text, msg_id), title, after)
        return True

    async def _start_reply(self, history: list[dict], text: str, t0: float,
                           user: tuple[str, int] | None = None,
                           title: str | None = None, after=()) -> None:
        """Start the engine on the reply, then show it (and `user`, the text and id of the
        message it answers, when that is new; `title`, the app's new title): the engine's
        prefill runs while the screen shows the new messages, instead of after. No
        ReplyEvent is handled before this returns (the screen handles its messages one at a
        time), so the reply's widgets exist by then."""
        app = self.app
        s = app.settings
        self._gen += 1
        # the engine first: everything below runs while it prefills
        params = s.sampler_params()
        self._generate(self._gen, app.engine.submit(history, text, params,
                                                    s.max_new_tokens, self.system_prompt))
        try:
            msg_id = app.store.add_message(self.chat_id, "assistant", "", finish=None)
        except BaseException:
            app.engine.cancel()   # nobody would read the reply
            raise
        pair = self._take_next()   # mounted while idle (_prepare_next), or None
        if pair is not None:
            user_widget, widget = pair
            if user is not None:
                user_widget.update(user[0])
                user_widget.msg_id = user[1]
            else:
                user_widget.remove()   # a regenerated reply answers a message shown already
                user_widget = None
        else:
            user_widget = UserMessage(*user) if user is not None else None
            widget = AssistantMessage("", None, finish=None, streaming=True)
        widget.msg_id = msg_id
        # an engine on the CPU needs the cores the UI paints with (CPU_ENGINE_UI_SHARE)
        share = CPU_ENGINE_UI_SHARE if app.engine.info.device == "cpu" else None
        stream = AssistantMessage.get_stream(widget, share)
        info = app.engine.info
        made = dict(model=info.name, backend=info.backend, device=info.device,
                    sampler=dataclasses.asdict(params))   # stored with the reply's figures
        self.reply = self.last_reply = _Streaming(self._gen, msg_id, widget, stream, made)
        # the first text's frame at once; the panel and the title after it
        perf = self.perf
        perf.hold()
        after = [perf.release, *after]
        if title is not None:
            after.append(lambda: setattr(app, "title", title))
        _FirstFrame(app, stream, after)
        perf.start_reply(t0)
        box = self.query_one("#messages", VerticalScroll)
        if pair is not None:
            for w in (user_widget, widget):
                if w is not None:
                    w.display = True
        else:
            await box.mount_all([w for w in (user_widget, widget) if w is not None])
            await widget.open_block()
        box.scroll_end(animate=False)   # a new turn follows the stream again
        # (The new messages' frame is the update timer's: forced here, once the screen had
        # their layout requests, the first append after it took 3-8 ms instead of 1 on the
        # H200 and Enter -> text rose 5-18 ms; RESULTS.md, session 12.)

    def _generate(self, gen_id: int, events: Iterator[ServiceEvent]) -> None:
        """Iterate the reply's events in a thread started here and now; the UI hears only
        batched events, by message (post_message is thread-safe). Not a Textual thread
        worker: one starts only once the event loop next runs its task, after this turn's
        mounts, and measured 4-8 ms after Enter while the prefill waited for it."""
        def run() -> None:
            try:
                for ev in events:
                    self.post_message(ReplyEvent(gen_id, ev))
            except Exception as e:  # noqa: BLE001 - the service should not raise; if so, say so
                self.post_message(ReplyEvent(gen_id, Failed(f"{type(e).__name__}: {e}",
                                                            "engine")))
        threading.Thread(target=run, name=f"nanoqwen-reply-{gen_id}").start()

    async def on_reply_event(self, m: ReplyEvent) -> None:
        r = self.reply
        if r is None or m.gen_id != r.gen_id:
            return
        ev = m.event
        store = self.app.store
        if isinstance(ev, Batch):
            shown_at = None
            if ev.text:
                r.batches += 1
                r.text += ev.text
                store.update_message(r.msg_id, r.text)   # on disk before it is on screen
                await r.stream.write(ev.text)
                shown_at = self.clock()
            if ev.stats is not None:
                self.perf.record(ev.stats, shown_at)
        elif isinstance(ev, Note):
            self.notify(ev.message, severity="warning", timeout=8)
        elif isinstance(ev, (Finished, Failed)):
            self.reply = None
            stats = ev.stats.__dict__ if isinstance(ev, Finished) and ev.stats else None
            if stats:
                self.perf.record(ev.stats)
                stats = {k: v for k, v in stats.items() if k != "step_ms"}
                stats.update(r.made, seen_ttft_ms=self.perf.seen_ttft_ms,
                             screen_tokens_per_s=self.perf.screen_tokens_per_s)
            finish = ev.reason if isinstance(ev, Finished) else "error"
            error = ev.message if isinstance(ev, Failed) else None
            if error:
                stats = {"error": error, **r.made}   # the reason stays with the reply
            store.update_message(r.msg_id, r.text, finish=finish, stats=stats)
            await r.stream.stop()
            self._trim()
            # after the reply's last frame, while nobody waits: the next turn's widgets,
            # then a collection (heap.py)
            self.call_after_refresh(self._prepare_next)
            heap.collect_soon(self.app)
            r.widget.set_finish(finish, error=error)
            if isinstance(ev, Failed):
                title = {"oom": "Out of memory", "context": "Context full"}.get(ev.kind,
                                                                                "Engine error")
                self.notify(ev.message, title=title, severity="error", timeout=15)
            elif ev.reason == "context":
                self.notify("The context is full: start a new chat (ctrl+n)",
                            severity="warning", timeout=10)

    # --- actions -------------------------------------------------------------------------
    def action_stop(self) -> None:
        if self.generating and self.app.engine is not None:
            self.app.engine.cancel()

    def _idle(self, what: str) -> bool:
        if self.generating:
            self.notify(f"Stop the reply first (esc) to {what}", severity="warning")
            return False
        return True

    async def action_regenerate(self) -> None:
        t0 = self.clock()   # the key press, as Enter is for send
        if not self._idle("regenerate"):
            return
        if self.chat_id is None:
            self.notify("There is no reply to regenerate yet", severity="warning")
            return
        if self.app.engine is None:
            self.notify("No model is loaded: ctrl+l opens one", severity="warning")
            return
        msgs = self.app.store.messages(self.chat_id)
        users = [i for i, m in enumerate(msgs) if m.role == "user"]
        if not users:
            self.notify("There is no message to regenerate a reply for", severity="warning")
            return
        i = users[-1]
        for m in msgs[i + 1:]:
            self.app.store.delete_message(m.id)
            for w in self.query(".message"):
                if getattr(w, "msg_id", None) == m.id:
                    await w.remove()
        history = self._history(msgs[:i])
        await self._start_reply(history, msgs[i].content, t0)

    def action_new_chat(self) -> None:
        if self._idle("start a new chat"):
            self.open_chat(None)
            self.perf.start_reply()
            self.query_one("#prompt").focus()

    def action_past_chats(self) -> None:
        if not self._idle("open another chat"):
            return

        def done(chat_id: int | None) -> None:
            if chat_id is not None:
                self.open_chat(chat_id)
            elif self.chat_id is not None and self.app.store.chat(self.chat_id) is None:
                self.open_chat(None)   # the open chat was deleted there: a new one
        self.app.push_screen(ChatsScreen(self.app.store, self.chat_id, self.edit_chat), done)

    def action_copy_code(self) -> None:
        """The last code block; pressed again within COPY_CYCLE_S, the one before it (from
        the first back to the last), so any block can be copied by key. F2: tmux's and
        screen's prefixes (ctrl+b, ctrl+a) and the prompt's editing keys stay free."""
        fences = list(self.query(CodeFence))
        if not fences:
            self.notify("There is no code block in this chat", severity="warning")
            return
        now, (last_t, last_i, last_n) = self.clock(), self._copied
        again = now - last_t < COPY_CYCLE_S and last_n == len(fences)
        i = (last_i - 1) % len(fences) if again else len(fences) - 1
        self._copied = (now, i, len(fences))
        fence = fences[i]
        for f in fences:
            f.set_class(f is fence, "-copied")
        fence.scroll_visible(animate=False)
        lang = f"{fence.lexer} " if fence.lexer else ""
        self.app.copy_code(fence.code, f"{lang}block {i + 1} of {len(fences)}")

    def action_export(self) -> None:
        if self.chat_id is None:
            self.notify("Nothing to export yet", severity="warning")
            return
        chat_id = self.chat_id
        slug = re.sub(r"[^A-Za-z0-9]+", "-", self.app.store.chat_title(chat_id)).strip("-")
        default = Path.cwd() / f"nanoqwen-{chat_id}-{slug[:40] or 'chat'}.md"

        def done(path: str | None) -> None:
            if path is None:
                return
            target = Path(path).expanduser()
            try:
                target.write_text(self.app.store.export_markdown(chat_id), encoding="utf-8")
            except OSError as e:
                self.notify(f"Could not write {target}: {e}", severity="error")
                return
            self.notify(f"Exported to {target}")
        self.app.push_screen(ExportScreen(str(default)), done)

    def fit_panel(self) -> None:
        """Show the perf panel as the settings say (perf_panel), folded to its one line
        when beside the chat it would leave the conversation fewer than CHAT_MIN_COLUMNS."""
        want = self.app.settings.perf_panel
        width = self.size.width or self.app.size.width
        if want == "full" and width - PANEL_WIDTH < CHAT_MIN_COLUMNS:
            want = "line"
        panel = self.perf
        panel.display = want != "hidden"
        panel.fold(want == "line")

    def on_resize(self) -> None:
        self.fit_panel()

    def action_perf_panel(self) -> None:
        """F3: full -> line -> hidden -> full (saved). Where "full" does not fit, it shows
        as the line, so the key is then line -> hidden -> line."""
        app = self.app
        order = PERF_PANEL
        now = app.settings.perf_panel
        narrow = (self.size.width or app.size.width) - PANEL_WIDTH < CHAT_MIN_COLUMNS
        nxt = order[(order.index(now) + 1) % len(order)]
        if narrow and now == "hidden":
            nxt = "full"           # shows as the line here; beside the chat where it fits
        elif narrow and now == "full":
            nxt = "hidden"         # "full" already showed as the line
        app.settings.perf_panel = nxt
        app._save_settings()
        self.fit_panel()

    def action_toggle_mode(self) -> None:
        self.app.toggle_mode()

    def action_settings(self) -> None:
        self.app.action_settings()

    def action_open_model(self) -> None:
        if self._idle("open another model"):
            self.app.action_open_model()
