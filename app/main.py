"""`nanoqwen-chat`: the App (settings, history store, model loading, global actions, command
palette) and the console entry point. The chat itself is app/chat.py.

Model choice at start: --model, else the last model used (settings.last_model), else the
engine's bundled model (`default_model_path()`). Loading runs in a thread worker with a
progress bar; a model that cannot be used opens the model screen with the reason (never a
traceback) and the app stays up without a model until one loads.

Everything model-side goes through one `nanoqwen.engine.EngineService` (`self.engine`): the
app imports no torch and reads no backend attribute. Torch is first imported by the load
worker, when the service opens the model, so the screen is up before torch costs anything.

Test hooks (documented, used by tests/test_app*.py): `settings_path` / `db_path` put the
settings and the history elsewhere (tests usually set XDG_CONFIG_HOME/XDG_DATA_HOME
instead, which platformdirs honours); `freeze_perf=True` or NANOQWEN_FREEZE_PERF=1 shows
"(frozen)" for the timing figures so SVG snapshots are deterministic.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterable
from functools import partial
from pathlib import Path

from textual import work
from textual.app import App, SystemCommand
from textual.binding import Binding
from textual.message import Message
from textual.screen import Screen

from nanoqwen.engine.sampling import SamplerParams
from nanoqwen.engine.service import BACKENDS, MODES, EngineService, default_model_path

from . import frames, heap
from .chat import CHAT_ACTIONS, ChatScreen
from .perf import ModelInfo
from .screens import HelpScreen, ModelScreen, SettingsScreen
from .settings import SPECULATION_NAMES, Settings, load_settings, save_settings
from .store import ChatStore, StoreError
from .widgets import ENTER_HINT

LOAD_PROGRESS_INTERVAL = 0.05  # seconds between progress messages from the load worker
# The longest a thread that wants the GIL waits while the UI thread holds it (CPython's default
# is 5 ms). The generation worker needs the GIL briefly a few times per reply on CUDA (to
# tokenize, to enter the C++ prefill, to detokenize each batch) and once per token on the CPU
# backend (its sampler); every screen update holds the GIL for several ms, so with the default
# each of those hand-offs could wait up to 5 ms behind a paint: on Enter, while the new
# messages paint, that added ~10-20 ms to the time to the first text. 0.5 ms -> 0.2 ms (a
# turn's start now needs the GIL back twice, after start_turn and after the first token):
# Enter -> text 1.4-6.6 ms lower in all four H200 cases (graph/eager, new chat/next turn,
# medians of 3, benchmarks/lab/app_switch_interval.py, RESULTS.md session 12), the CPU
# backend's turn in the app no slower against the engine alone (1.32 / 1.16 vs 1.39 / 1.27).
GIL_SWITCH_INTERVAL = 0.0002


class ModelLoaded(Message):
    def __init__(self, engine: EngineService) -> None:
        super().__init__()
        self.engine = engine


class ModelFailed(Message):
    """The model could not be opened; `unavailable`, when the file is not the reason: the
    backend asked for, which cannot run on this machine."""

    def __init__(self, path: Path, reason: str, unavailable: str | None = None) -> None:
        super().__init__()
        self.path = path
        self.reason = reason
        self.unavailable = unavailable


class DraftReady(Message):
    """The worker's answer to a draft model setting: `error` None when `path` drafts now."""

    def __init__(self, path: Path, error: str | None) -> None:
        super().__init__()
        self.path, self.error = path, error


class LoadProgress(Message):
    def __init__(self, done: int, total: int, what: str) -> None:
        super().__init__()
        self.done, self.total, self.what = done, total, what


class NanoqwenApp(App[None]):
    TITLE = "nanoqwen-chat"
    BINDINGS = [Binding("f1", "help", "Help")]

    def __init__(self, model: str | Path | None = None, backend: str = "auto",
                 mode: str | None = None, settings_path: Path | None = None,
                 db_path: Path | None = None, freeze_perf: bool | None = None,
                 threads: int | None = None) -> None:
        super().__init__()
        self.threads_arg = threads   # --threads: over the saved CPU threads setting
        self.model_arg = Path(model) if model else None
        self.backend_arg = backend
        self.mode_arg = mode
        self.settings_path = settings_path
        self.db_path = db_path
        self.freeze_perf = (os.environ.get("NANOQWEN_FREEZE_PERF") == "1"
                            if freeze_perf is None else freeze_perf)
        self.settings, self._settings_warning = load_settings(settings_path)
        try:
            self.store = ChatStore(db_path)
            self._store_warning = None
        except StoreError as e:
            # Keep the app usable: chats of this run live in memory only.
            self.store = ChatStore(":memory:")
            self._store_warning = f"{e}. Chats of this session will not be saved."
        self.engine: EngineService | None = None   # the loaded model, through the service
        self.model_sampler: SamplerParams | None = None   # its file's sampler defaults
        self.loading = False

    # A mode (not get_default_screen) so Textual loads the screen's own CSS_PATH.
    MODES = {"chat": ChatScreen}
    DEFAULT_MODE = "chat"
    chat: ChatScreen  # set by the chat screen when it mounts; it lives as long as the app

    def chat_ready(self) -> None:
        """Called by the chat screen once it is mounted (its widgets exist from then on)."""
        for warning in (self._settings_warning, self._store_warning):
            if warning:
                self.notify(warning, severity="warning", timeout=12)
        self.load_model(self.initial_model_path())

    def initial_model_path(self) -> Path:
        if self.model_arg is not None:
            return self.model_arg
        last = self.settings.last_model
        if last and Path(last).exists():
            return Path(last)
        if last:
            self.notify(f"The last model, {last}, is gone; opening the bundled one",
                        severity="warning")
        return default_model_path()

    # --- model loading -----------------------------------------------------------------
    def load_model(self, path: Path) -> None:
        if self.loading:
            self.notify("A model is already loading", severity="warning")
            return
        self.loading = True
        self.chat.show_loading(path)
        mode = self.mode_arg or self.settings.decode_mode
        self._load(Path(path), self.backend_arg, mode)

    @work(thread=True, group="load", exit_on_error=False)
    def _load(self, path: Path, backend: str, mode: str) -> None:
        last = 0.0

        def progress(done: int, total: int, what: str = "") -> None:
            nonlocal last
            now = time.monotonic()
            if now - last >= LOAD_PROGRESS_INTERVAL or done >= total:
                last = now
                self.post_message(LoadProgress(done, total, what))

        from nanoqwen.engine.errors import BackendUnavailable, NanoqwenError

        try:
            threads = self.threads_arg or self.settings.cpu_threads or None   # 0: per core
            engine = EngineService.open(path, backend=backend, mode=mode, progress=progress,
                                        threads=threads)
        except BackendUnavailable as e:   # the machine's state, not the file's
            self.post_message(ModelFailed(path, str(e),
                                          unavailable=backend if backend != "auto" else None))
        except NanoqwenError as e:
            self.post_message(ModelFailed(path, str(e)))
        except Exception as e:  # noqa: BLE001 - an unusable file must not become a traceback
            self.post_message(ModelFailed(path, f"{type(e).__name__}: {e}"))
        else:
            self.post_message(ModelLoaded(engine))

    def on_load_progress(self, m: LoadProgress) -> None:
        self.chat.load_progress(m.done, m.total, m.what)

    def on_model_loaded(self, m: ModelLoaded) -> None:
        self.loading = False
        old, self.engine = self.engine, m.engine
        if old is not None:
            old.close()
        info = m.engine.info
        self.settings.last_model = str(info.path.resolve())
        try:
            self.model_sampler = SamplerParams.model_defaults(info.generation)
        except ValueError as e:   # a file whose generation config the engine refuses
            self.model_sampler = None
            self.notify(f"The model's generation defaults are not usable ({e}); the saved "
                        "sampler settings apply", severity="warning")
        if self.settings.model_sampler and self.model_sampler is not None:
            self.settings = self.settings.with_model_sampler(self.model_sampler)
        self._save_settings()
        self._apply_speculation(loaded=True)
        self.chat.model_ready(ModelInfo(info.backend, info.device, info.name, info.modes,
                                        m.engine.mode, info.max_context, info.fallback))
        self.call_after_refresh(heap.settle)   # the loaded model and the app: frozen (heap.py)
        msg = f"{info.name} on the {info.backend} backend ({info.device})"
        if info.fallback:
            msg += f": {info.fallback}"
        self.notify(msg, title="Model loaded")
        if self.mode_arg:  # asked for on the command line: say it could not be had
            for w in info.warnings:
                self.notify(w, severity="warning")

    def on_model_failed(self, m: ModelFailed) -> None:
        self.loading = False
        self.chat.hide_loading()
        if m.unavailable is not None:
            reason = (f"The {m.unavailable} backend cannot run on this machine: {m.reason}\n\n"
                      f"The model file {m.path} was not the problem: start nanoqwen-chat "
                      "with --backend auto (or reference) to use it on the CPU. Cancel "
                      "continues without a model.")
        else:
            reason = (f"Could not use the model {m.path}:\n\n{m.reason}\n\n"
                      "Pick another .nanoqwen file, or Cancel to continue without a model.")
        self.push_screen(ModelScreen(str(m.path), reason), self._picked_model)

    def _picked_model(self, path: str | None) -> None:
        if path:
            self.load_model(Path(path).expanduser())

    def action_open_model(self) -> None:
        current = str(self.engine.info.path) if self.engine else ""
        self.push_screen(ModelScreen(current), self._picked_model)

    # --- settings and decode mode ----------------------------------------------------------
    def _save_settings(self) -> None:
        try:
            save_settings(self.settings, self.settings_path)
        except OSError as e:
            self.notify(f"Could not save the settings: {e}", severity="error")

    def action_settings(self) -> None:
        modes = self.engine.info.modes if self.engine else None
        defaults = self.model_sampler if self.engine else None
        spec_modes = self.engine.info.spec_modes if self.engine else None
        self.push_screen(SettingsScreen(self.settings, modes, defaults, spec_modes),
                         self._settings_done)

    def _settings_done(self, new: Settings | None) -> None:
        if new is None:
            return
        new.last_model = self.settings.last_model
        self.settings = new
        self._save_settings()
        if self.engine is not None and new.decode_mode in self.engine.info.modes:
            self.engine.set_mode(new.decode_mode)
            self.chat.perf.set_mode(new.decode_mode)
        self._apply_speculation()
        self.notify("Saved; they apply from the next reply", title="Settings")

    def _apply_speculation(self, loaded: bool = False) -> None:
        """The saved speculation setting on the engine where its backend verifies it; a
        backend without it decodes plainly (said once, when a model loads)."""
        if self.engine is None:
            return
        want = self.settings.speculation
        have = self.engine.info.spec_modes
        if want == "auto":   # what this backend is measured faster with; nothing to say
            want = self.engine.info.spec_auto or "off"
            want = want if want in have else "off"
        if want == "draft" and want in have:
            # a model file to load (seconds on a big one): in a worker; replies decode as
            # before until it is ready
            self._load_draft(self.engine, Path(self.settings.draft_model).expanduser())
            return
        self.engine.set_spec(want if want in have else None)
        if want != "off" and want not in have and loaded:
            self.notify(f"{SPECULATION_NAMES[want].capitalize()} is not available on the "
                        f"{self.engine.info.backend} backend yet; replies decode one token "
                        "per step", title="Speculative decoding", severity="warning", timeout=8)

    @work(thread=True, group="draft", exclusive=True, exit_on_error=False)
    def _load_draft(self, engine: EngineService, path: Path) -> None:
        from nanoqwen.engine.errors import NanoqwenError

        already = engine.draft_path is not None and engine.draft_path == path.resolve()
        try:
            engine.set_spec("draft", draft=path)   # the same file again: kept, not reloaded
        except (NanoqwenError, ValueError) as e:
            error = str(e)
        except Exception as e:  # noqa: BLE001 - an unusable file must not become a traceback
            error = f"{type(e).__name__}: {e}"
        else:
            if already:
                return   # loaded already: nothing to say
            error = None
        self.post_message(DraftReady(path, error))

    def on_draft_ready(self, m: DraftReady) -> None:
        if m.error is not None and self.engine is not None \
                and self.settings.speculation == "draft" \
                and Path(self.settings.draft_model).expanduser() == m.path:
            self.engine.set_spec(None)   # plainly rather than with an earlier draft model
        if m.error is None:
            self.notify(f"Drafting with {m.path.name}", title="Speculative decoding")
        else:
            self.notify(f"Could not use the draft model {m.path}: {m.error}\n\nReplies "
                        "decode one token per step; pick another file in the settings.",
                        title="Speculative decoding", severity="error", timeout=12)

    def toggle_mode(self) -> None:
        b = self.engine
        if b is None:
            self.notify("No model is loaded", severity="warning")
            return
        modes = b.info.modes
        if len(modes) < 2:
            # Nothing to switch: say so rather than flip a label.
            self.notify(f"The {b.info.backend} backend has only {modes[0]} decode; "
                        "CUDA-graph decode needs the CUDA backend (a GPU and the built "
                        "extension).", title="Decode mode", severity="warning", timeout=8)
            return
        new = modes[(modes.index(b.mode) + 1) % len(modes)]
        b.set_mode(new)   # read by the backend before each token: no reload
        self.settings.decode_mode = new
        self._save_settings()
        self.chat.perf.set_mode(new)
        self.notify(f"Decode mode: {new} (from the next token)", title="Decode mode")

    # --- misc actions ------------------------------------------------------------------------
    def copy_code(self, code: str, which: str = "a code block") -> None:
        self.copy_to_clipboard(code)
        n = code.count("\n") + (0 if code.endswith("\n") else 1)
        self.notify(f"Copied {which} ({n} line{'s' if n != 1 else ''}) to the clipboard")

    def key_bindings(self) -> list[tuple[str, str]]:
        rows = [("enter", "Send the message"), ("shift+enter, ctrl+j", "New line in the prompt"),
                ("up, down", "Earlier prompts (on the prompt's first / last line)"),
                ("pageup, pagedown", "Scroll the conversation (home, end: in an empty prompt)"),
                ("pageup at the top", "Earlier messages of a long chat")]
        rows += [(key, desc) for key, _, _, desc, _ in CHAT_ACTIONS]
        rows += [("click a code block", "Copy it"), ("ctrl+p", "Command palette"),
                 ("f1", "This help"), ("ctrl+q", "Quit")]
        return rows

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(self.key_bindings()))

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for _, action, short, desc, _ in CHAT_ACTIONS:
            yield SystemCommand(short, desc, partial(self.chat.run_action, action))
        yield SystemCommand("Help", "Show the key bindings", self.action_help)

    def on_load(self) -> None:
        # Process-wide: set for the app's lifetime, restored when it unmounts.
        self._old_switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(GIL_SWITCH_INTERVAL)
        frames.install()   # a partial frame renders the widgets it shows (frames.py)

    def on_unmount(self) -> None:
        old = getattr(self, "_old_switch_interval", None)
        if old is not None:
            sys.setswitchinterval(old)
        frames.uninstall()
        heap.restore()   # a frame hold cut short by the exit leaves collections off
        # Quitting mid-reply is a stop: the text is on disk already; record how it ended.
        reply = getattr(self, "chat", None) and self.chat.reply
        if reply:
            self.store.update_message(reply.msg_id, reply.text, finish="cancelled")
        if self.engine is not None:
            self.engine.cancel()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="nanoqwen-chat",
                                 description=f"Chat with a local Qwen2.5-Coder model. {ENTER_HINT}.")
    ap.add_argument("--model", "-m", metavar="FILE", help="a .nanoqwen model "
                    "(default: the last one used, else the bundled model)")
    ap.add_argument("--backend", choices=BACKENDS, default="auto",
                    help="auto: CUDA when a GPU and the built extension are there")
    ap.add_argument("--mode", choices=MODES, default=None,
                    help="decode mode to start in (default: the saved setting)")
    ap.add_argument("--threads", "-t", type=int, default=None,
                    help="CPU threads of the reference backend (default: the saved setting, "
                         "else one per core)")
    args = ap.parse_args(argv)
    cores = os.cpu_count() or 1
    if args.threads is not None and not 1 <= args.threads <= cores:
        ap.error(f"--threads {args.threads}: give a whole number from 1 to {cores} "
                 "(this machine's CPUs)")
    NanoqwenApp(model=args.model, backend=args.backend, mode=args.mode,
                threads=args.threads).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
