"""The app's modal screens. Each returns its result with `dismiss` (ModalScreen[T]) and has
its own .tcss file next to it:

    SettingsScreen   -> Settings | None    sampler, reply length, system prompt, decode mode
    HelpScreen       -> None               the key bindings, generated from the bindings
    ModelScreen      -> str | None         model picker; opened with the reason when a model
                                           cannot be used (the error screen of issue 4)
    ExportScreen     -> str | None         where to write a chat as Markdown
    ChatsScreen      -> int | None         past chats to reopen
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

from .settings import DECODE_MODES, LABELS, SAMPLER_FIELDS, Settings, SettingsError
from .store import ChatSummary

# Numeric fields in form order: (field, hint shown beside the input)
_NUMBER_FIELDS = [
    ("temperature", "> 0"),
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
                 model_sampler: SamplerParams | None = None) -> None:
        super().__init__()
        self.settings = settings
        self.modes = modes  # what the loaded backend can do; None: no model loaded
        self.model_sampler = model_sampler  # the loaded model's sampler defaults

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
                yield Label(LABELS["system_prompt"] + " [dim](empty: the model's default)[/]")
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

    def form(self) -> dict:
        f: dict = {name: self.query_one(f"#{name}", Input).value for name, _ in _NUMBER_FIELDS}
        f["greedy"] = self.query_one("#greedy", Switch).value
        picked = self.query_one("#decode_mode", Select).value
        # a backend with one mode offers no choice: the saved one (for other backends) stays
        f["decode_mode"] = picked if self.modes is None or len(self.modes) > 1 \
            else self.settings.decode_mode
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
    """Past chats, newest first; Enter reopens one."""

    CSS_PATH = "chats.tcss"
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, chats: list[ChatSummary], current: int | None = None) -> None:
        super().__init__()
        self.chats = chats
        self.current = current

    def compose(self) -> ComposeResult:
        with Vertical(id="chats-dialog"):
            yield Label("Past chats", id="chats-title")
            if not self.chats:
                yield Static("No chats yet.", id="chats-empty")
            options = []
            for c in self.chats:
                when = time.strftime("%Y-%m-%d %H:%M", time.localtime(c.updated))
                mark = " [b](open)[/]" if c.id == self.current else ""
                options.append(Option(f"{c.title}{mark}\n[dim]{when} · {c.n_messages} messages"
                                      f" · {c.model}[/]", id=str(c.id)))
            yield OptionList(*options, id="chats-list")
            yield Static("[dim]enter open · esc close[/]", id="chats-footer")

    @on(OptionList.OptionSelected)
    def _selected(self, event: OptionList.OptionSelected) -> None:
        self.dismiss(int(event.option.id))

    def action_cancel(self) -> None:
        self.dismiss(None)
