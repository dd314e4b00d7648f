"""The app's modal screens. Each returns its result with `dismiss` (ModalScreen[T]) and has
its own .tcss file next to it:

    SettingsScreen   -> Settings | None    sampler, reply length, system prompt, decode mode
    HelpScreen       -> None               the key bindings, generated from the bindings
    ModelScreen      -> str | None         model picker; opened with the reason when a model
                                           cannot be used (the error screen of issue 4)
    ExportScreen     -> str | None         where to write a chat as Markdown
    ChatsScreen      -> int | None         past chats: search, reopen, delete, rename
    ConfirmScreen    -> bool               a yes/no question (deleting a chat)
    ChatEditScreen   -> (str, str) | None  a chat's title and system prompt
"""

from __future__ import annotations

import time

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import (Button, Input, Label, OptionList, Select, Static, Switch,
                             TextArea)
from textual.widgets.option_list import Option

from nanoqwen.engine.sampling import SamplerParams

from .settings import (DECODE_MODES, LABELS, SAMPLER_FIELDS, SPECULATION, SPECULATION_NAMES,
                       Settings, SettingsError)
from .store import ChatSummary

# Numeric fields in form order: (field, hint shown beside the input)
_NUMBER_FIELDS = [
    ("temperature", "0 = greedy"),
    ("top_k", "0 = off"),
    ("top_p", "1 = off"),
    ("min_p", "0 = off"),
    ("repeat_penalty", "1 = off"),
    ("repeat_last_n", "tokens; -1 = all"),
    ("seed", "-1 = random"),
    ("max_new_tokens", "per reply"),
    ("cpu_threads", "CPU backend; 0 = per core; next load"),
]


class _FitsTerminal:
    """A dialog that stays usable in a short terminal: when the whole of it does not fit,
    the screen gets the class -short, with which its .tcss gives the dialog the screen's
    height and the scrolling part (`FIT`, a selector) the rows the title, buttons and
    footer leave, so those stay on screen and the rest scrolls. In a tall terminal the
    dialog keeps its own height. Checked on mount and on every resize."""

    FIT = ""

    def on_mount(self) -> None:
        self.call_after_refresh(self.fit)

    def on_resize(self) -> None:
        self.call_after_refresh(self.fit)

    def fit(self) -> None:
        part = self.query_one(self.FIT)
        dialog = part.parent
        # what the dialog needs whole: its border and padding, and each part's full height
        need = dialog.gutter.height
        for w in dialog.children:
            if w.display:
                h = w.virtual_size.height if w is part else w.outer_size.height
                need += h + w.styles.margin.height
        self.set_class(need > self.size.height, "-short")


class SettingsScreen(_FitsTerminal, ModalScreen[Settings | None]):
    """Edit the settings; Save validates every field and marks the bad ones in place."""

    AUTO_FOCUS = "#greedy"   # the first field (the form's scroll container would take it)
    FIT = "#settings-form"

    CSS_PATH = "settings.tcss"
    BINDINGS = [
        Binding("escape", "cancel", "Cancel"),
        Binding("ctrl+s", "save", "Save", priority=True),
    ]

    def __init__(self, settings: Settings, modes: tuple[str, ...] | None = None,
                 model_sampler: SamplerParams | None = None,
                 spec_modes: tuple[str, ...] | None = None) -> None:
        super().__init__()
        self.settings = settings
        self.modes = modes  # what the loaded backend can do; None: no model loaded
        self.model_sampler = model_sampler  # the loaded model's sampler defaults
        self.spec_modes = spec_modes  # the speculation it verifies; None: no model loaded

    def compose(self) -> ComposeResult:
        s = self.settings
        with Vertical(id="settings-dialog"):
            yield Label("Settings", id="settings-title")
            with VerticalScroll(id="settings-form"):
                with Grid(id="settings-grid"):
                    yield Label(LABELS["greedy"])
                    yield Switch(value=s.greedy, id="greedy")
                    yield Static("[dim]on: always the most likely token[/]",
                                 classes="hint", id="greedy-error")
                    for name, hint in _NUMBER_FIELDS:
                        yield Label(LABELS[name])
                        yield Input(str(getattr(s, name)), id=name, compact=True,
                                    select_on_focus=False)
                        yield Static(f"[dim]{hint}[/]", classes="hint", id=f"{name}-error")
                    yield Label(LABELS["decode_mode"])
                    # only the modes the loaded backend has; the saved choice shows where
                    # it is one of them (it stays saved for a backend that has it)
                    offered = [m for m in DECODE_MODES if self.modes is None or m in self.modes]
                    yield Select([(m, m) for m in offered],
                                 value=s.decode_mode if s.decode_mode in offered else offered[0],
                                 allow_blank=False, id="decode_mode", compact=True)
                    yield Static(self._mode_hint(), classes="hint", id="decode_mode-error")
                    yield Label(LABELS["speculation"])
                    # as the decode mode: what the backend verifies, the saved choice kept
                    spec_offered = [m for m in SPECULATION if m in ("auto", "off")
                                    or self.spec_modes is None or m in self.spec_modes]
                    yield Select([(SPECULATION_NAMES[m], m) for m in spec_offered],
                                 value=s.speculation if s.speculation in spec_offered else "auto",
                                 allow_blank=False, id="speculation", compact=True)
                    yield Static(self._spec_hint(), classes="hint", id="speculation-error")
                    yield Label(LABELS["draft_model"])
                    yield Input(s.draft_model, id="draft_model", compact=True,
                                select_on_focus=False, placeholder="path to a .nanoqwen file")
                    yield Static("[dim]for draft model: a smaller model of the same "
                                 "tokenizer[/]", classes="hint", id="draft_model-error")
                yield Label(LABELS["system_prompt"] + " for new chats [dim](empty: the model's "
                            "default; a chat's own: ctrl+o, ctrl+e)[/]")
                yield TextArea(s.system_prompt, id="system_prompt", compact=True)
            yield Static("", id="settings-errors")
            with Horizontal(id="settings-buttons"):
                yield Button("Save", variant="primary", id="save", compact=True)
                yield Button("Cancel", id="cancel", compact=True)
                yield Button("Model's defaults", id="model-defaults", compact=True,
                             disabled=self.model_sampler is None,
                             tooltip="the sampler values the model file comes with")
            yield Static("[dim]ctrl+s save · esc cancel · applies to the next reply[/]",
                         id="settings-footer")

    def _mode_hint(self) -> str:
        if self.modes is None:
            return "[dim]no model loaded[/]"
        if len(self.modes) == 1:
            return f"[dim]this backend runs only {self.modes[0]}[/]"
        return "[dim]graph: CUDA graphs[/]"

    def _spec_hint(self) -> str:
        if self.spec_modes is not None and not self.spec_modes:
            return "[dim]not on this backend yet[/]"
        return "[dim]drafts from the chat, verified: the same reply, sooner[/]"

    def form(self) -> dict:
        f: dict = {name: self.query_one(f"#{name}", Input).value for name, _ in _NUMBER_FIELDS}
        f["greedy"] = self.query_one("#greedy", Switch).value
        picked = self.query_one("#decode_mode", Select).value
        # a backend with one mode offers no choice: the saved one (for other backends) stays
        f["decode_mode"] = picked if self.modes is None or len(self.modes) > 1 \
            else self.settings.decode_mode
        picked = self.query_one("#speculation", Select).value
        # a backend without speculation offers only off: the saved choice stays
        f["speculation"] = picked if self.spec_modes is None or self.spec_modes \
            else self.settings.speculation
        f["draft_model"] = self.query_one("#draft_model", Input).value.strip()
        f["system_prompt"] = self.query_one("#system_prompt", TextArea).text
        return f

    def action_save(self) -> None:
        for w in self.query(".hint"):
            w.remove_class("error")
        try:
            new = Settings.from_form(self.form(), base=self.settings)
        except SettingsError as e:
            for name, msg in e.errors.items():
                hint = self.query_one(f"#{name}-error", Static)
                hint.update(msg)
                hint.add_class("error")
            self.query_one("#settings-errors", Static).update(
                f"[b]{len(e.errors)} setting(s) need fixing[/]: " + "; ".join(e.errors.values()))
            self.call_after_refresh(self.fit)   # the errors take rows from the form
            self.notify(str(e), title="Invalid settings", severity="error")
            return
        # sampling as the model's defaults do: the sampler follows the model (the next one
        # too); with no model loaded, it follows as before unless the values changed
        if self.model_sampler is not None:
            new.model_sampler = new.same_sampler(new.with_model_sampler(self.model_sampler))
        else:
            new.model_sampler = self.settings.model_sampler and new.same_sampler(self.settings)
        self.dismiss(new)

    def action_model_defaults(self) -> None:
        """Fill the sampler fields with the loaded model's defaults (Save keeps them)."""
        if self.model_sampler is None:
            return
        d = self.settings.with_model_sampler(self.model_sampler)
        self.query_one("#greedy", Switch).value = d.greedy
        for name, _ in _NUMBER_FIELDS:
            if name in SAMPLER_FIELDS:
                self.query_one(f"#{name}", Input).value = str(getattr(d, name))

    @on(Button.Pressed, "#model-defaults")
    def _model_defaults_pressed(self) -> None:
        self.action_model_defaults()

    def action_cancel(self) -> None:
        self.dismiss(None)

    @on(Button.Pressed, "#save")
    def _save_pressed(self) -> None:
        self.action_save()

    @on(Button.Pressed, "#cancel")
    def _cancel_pressed(self) -> None:
        self.action_cancel()


class HelpScreen(_FitsTerminal, ModalScreen[None]):
    """The key bindings, from the same list the app binds, so it cannot drift."""

    CSS_PATH = "help.tcss"
    FIT = "#help-keys"
    BINDINGS = [Binding("escape,f1,q", "close", "Close")]

    def __init__(self, bindings: list[tuple[str, str]]) -> None:
        super().__init__()
        self.bindings = bindings

    def compose(self) -> ComposeResult:
        with Vertical(id="help-dialog"):
            yield Label("Keys", id="help-title")
            with VerticalScroll(id="help-keys"):
                with Grid(id="help-grid"):
                    for key, desc in self.bindings:
                        yield Label(key, classes="help-key", markup=False)
                        yield Static(desc, classes="help-desc", markup=False)
            yield Static("[dim]Every action is also in the command palette (ctrl+p). "
                         "Click a code block to copy it. esc closes.[/]", id="help-footer")

    def action_close(self) -> None:
        self.dismiss(None)


class _PathScreen(_FitsTerminal, ModalScreen[str | None]):
    """Ask for a file path; shared by the model picker and export."""

    CSS_PATH = "path.tcss"
    FIT = "#path-scroll"
    BINDINGS = [Binding("escape", "cancel", "Cancel")]
    TITLE_TEXT = ""
    OK_LABEL = "OK"

    def __init__(self, path: str = "", message: str | None = None) -> None:
        super().__init__()
        self.initial = path
        self.message = message

    def compose(self) -> ComposeResult:
        with Vertical(id="path-dialog"):
            yield Label(self.TITLE_TEXT, id="path-title")
            with VerticalScroll(id="path-scroll"):   # a long error message scrolls
                if self.message:
                    yield Static(self.message, id="path-message", markup=False)
            yield Input(self.initial, placeholder="path to a file", id="path-input")
            with Horizontal(id="path-buttons"):
                yield Button(self.OK_LABEL, variant="primary", id="ok", compact=True)
                yield Button("Cancel", id="cancel", compact=True)

    def on_mount(self) -> None:
        self.query_one("#path-input", Input).focus()   # (and _FitsTerminal.on_mount: both run)

    @on(Input.Submitted)
    @on(Button.Pressed, "#ok")
    def _ok(self) -> None:
        path = self.query_one("#path-input", Input).value.strip()
        if not path:
            self.notify("Enter a file path", severity="warning")
            return
        self.dismiss(path)

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)


class ModelScreen(_PathScreen):
    """Pick a model file. With `message`, it is the error screen for a model that failed."""

    TITLE_TEXT = "Open a model (.nanoqwen)"
    OK_LABEL = "Load"


class ExportScreen(_PathScreen):
    TITLE_TEXT = "Export the chat as Markdown"
    OK_LABEL = "Export"


class ChatsScreen(ModalScreen[int | None]):
    """Past chats, newest first: type to search titles and messages, Enter reopens one,
    ctrl+d deletes it (after a confirmation), ctrl+e renames it and edits its system
    prompt. Works on the store directly; dismisses with the chat to open (None: none)."""

    CSS_PATH = "chats.tcss"
    LIMIT = 200   # chats listed at once; the rest are found by searching
    BINDINGS = [
        Binding("escape", "cancel", "Close"),
        Binding("ctrl+d", "delete", "Delete", priority=True),   # (Input's delete-right)
        Binding("ctrl+e", "edit", "Rename / system prompt", priority=True),
        Binding("down", "move(1)", show=False),
        Binding("up", "move(-1)", show=False),
    ]

    def __init__(self, store, current: int | None = None, on_edit=None) -> None:
        super().__init__()
        self.store = store
        self.current = current
        self.on_edit = on_edit   # (chat_id, title, system prompt) -> None: the chat screen's
        self.chats: list[ChatSummary] = []

    def compose(self) -> ComposeResult:
        with Vertical(id="chats-dialog"):
            yield Label("Past chats", id="chats-title")
            yield Input(placeholder="search titles and messages", id="chats-search",
                        compact=True)
            yield OptionList(id="chats-list")
            yield Static("", id="chats-count")
            yield Static("[dim]enter open · ctrl+d delete · ctrl+e rename / system prompt · "
                         "esc close[/]", id="chats-footer")

    def on_mount(self) -> None:
        self.refresh_list()
        self.query_one("#chats-search", Input).focus()

    def refresh_list(self, keep: int | None = None) -> None:
        search = self.query_one("#chats-search", Input).value
        self.chats = self.store.list_chats(self.LIMIT, search)
        total = self.store.count_chats(search)
        options = []
        for c in self.chats:
            when = time.strftime("%Y-%m-%d %H:%M", time.localtime(c.updated))
            mark = " [b](open)[/]" if c.id == self.current else ""
            options.append(Option(f"{_escape(c.title)}{mark}\n[dim]{when} · {c.n_messages} "
                                  f"messages · {_escape(c.model)}[/]", id=str(c.id)))
        listing = self.query_one("#chats-list", OptionList)
        listing.clear_options()
        listing.add_options(options)
        ids = [c.id for c in self.chats]
        if ids:
            listing.highlighted = ids.index(keep) if keep in ids else 0
        if not total:
            count = "no chat matches" if search.strip() else "No chats yet."
        elif total > len(self.chats):
            count = f"the newest {len(self.chats)} of {total}: search to find the others"
        else:
            count = f"{total} chat{'s' if total != 1 else ''}" + (" match" if search.strip()
                                                                 else "")
        self.query_one("#chats-count", Static).update(f"[dim]{count}[/]")

    def _highlighted(self) -> ChatSummary | None:
        i = self.query_one("#chats-list", OptionList).highlighted
        return self.chats[i] if i is not None and 0 <= i < len(self.chats) else None

    @on(Input.Changed, "#chats-search")
    def _search(self) -> None:
        self.refresh_list()

    @on(Input.Submitted, "#chats-search")
    def _open_highlighted(self) -> None:
        c = self._highlighted()
        if c is not None:
            self.dismiss(c.id)

    @on(OptionList.OptionSelected)
    def _selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(int(event.option.id))

    def action_move(self, step: int) -> None:
        listing = self.query_one("#chats-list", OptionList)
        if step > 0:
            listing.action_cursor_down()
        else:
            listing.action_cursor_up()

    def action_delete(self) -> None:
        c = self._highlighted()
        if c is None:
            return

        def done(yes: bool | None) -> None:
            if yes:
                self.store.delete_chat(c.id)
                self.notify(f"Deleted “{c.title}”")
                self.refresh_list()
        self.app.push_screen(ConfirmScreen(
            f"Delete “{c.title}” and its {c.n_messages} messages? This cannot be undone.",
            "Delete"), done)

    def action_edit(self) -> None:
        c = self._highlighted()
        if c is None:
            return

        def done(result: tuple[str, str] | None) -> None:
            if result is None:
                return
            title, system = result
            if self.on_edit is not None:
                self.on_edit(c.id, title, system)
            else:
                self.store.set_title(c.id, title)
                self.store.set_system_prompt(c.id, system)
            self.refresh_list(keep=c.id)
        system = c.system_prompt if c.system_prompt is not None else ""
        self.app.push_screen(ChatEditScreen(c.title, system), done)

    def action_cancel(self) -> None:
        self.dismiss(None)


def _escape(text: str) -> str:
    """`text` shown literally in markup (a title can hold [brackets])."""
    return text.replace("[", "\\[")


class ConfirmScreen(ModalScreen[bool]):
    """A yes/no question; the safe answer has the focus (Enter on it does nothing harmful)."""

    CSS_PATH = "path.tcss"
    BINDINGS = [Binding("escape", "no", "Cancel")]
    AUTO_FOCUS = "#no"

    def __init__(self, question: str, yes_label: str = "OK") -> None:
        super().__init__()
        self.question = question
        self.yes_label = yes_label

    def compose(self) -> ComposeResult:
        with Vertical(id="path-dialog"):
            yield Static(self.question, id="confirm-question", markup=False)
            with Horizontal(id="path-buttons"):
                yield Button(self.yes_label, variant="error", id="yes", compact=True)
                yield Button("Cancel", id="no", compact=True)

    @on(Button.Pressed, "#yes")
    def _yes(self) -> None:
        self.dismiss(True)

    @on(Button.Pressed, "#no")
    def action_no(self) -> None:
        self.dismiss(False)


class ChatEditScreen(_FitsTerminal, ModalScreen[tuple[str, str] | None]):
    """A chat's title and its own system prompt (empty: the model's default)."""

    CSS_PATH = "path.tcss"
    FIT = "#chat-edit-form"
    AUTO_FOCUS = "#chat-title"
    BINDINGS = [Binding("escape", "cancel", "Cancel"),
                Binding("ctrl+s", "save", "Save", priority=True)]

    def __init__(self, title: str, system_prompt: str) -> None:
        super().__init__()
        self.initial = (title, system_prompt)

    def compose(self) -> ComposeResult:
        title, system = self.initial
        with Vertical(id="path-dialog"):
            yield Label("Chat", id="path-title")
            with VerticalScroll(id="chat-edit-form"):
                yield Label("Title")
                yield Input(title, id="chat-title", compact=True)
                yield Label("System prompt of this chat [dim](empty: the model's default)[/]")
                yield TextArea(system, id="chat-system", compact=True)
            with Horizontal(id="path-buttons"):
                yield Button("Save", variant="primary", id="ok", compact=True)
                yield Button("Cancel", id="cancel", compact=True)

    @on(Button.Pressed, "#ok")
    @on(Input.Submitted, "#chat-title")
    def action_save(self) -> None:
        title = self.query_one("#chat-title", Input).value.strip()
        if not title:
            self.notify("A chat needs a title", severity="warning")
            return
        self.dismiss((title, self.query_one("#chat-system", TextArea).text))

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        self.dismiss(None)
