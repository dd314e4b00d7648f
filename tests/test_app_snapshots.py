"""SVG snapshots of nanoqwen-chat (pytest-textual-snapshot): the chat screen with a highlighted
code answer, the settings screen and the help screen.

Deterministic by construction: greedy decoding of the tiny random-weight model (fixed seed)
on the CPU reference backend, a fixed terminal size, the perf panel's timing figures frozen
(`NanoqwenApp(freeze_perf=True)`: token counts stay real, ms and tok/s read "(frozen)"),
notifications cleared and the cursors not blinking. The code answer is a stored earlier turn
(the random-weight model cannot write code); the last turn is generated live.
Regenerate with `pytest tests/test_app_snapshots.py --snapshot-update` and review the SVGs.
"""

from __future__ import annotations

import pytest
from test_app import (CODE_CHAT, dirs, loaded, reply_done, seed_chat, send,  # noqa: F401
                      use_settings)

from nanoqwen.app.main import NanoqwenApp

SIZE = (110, 36)


async def settle(app, pilot) -> None:
    app.clear_notifications()
    for w in app.screen.query("Input, TextArea"):
        w.cursor_blink = False
    for w in app.chat.query("TextArea"):
        w.cursor_blink = False
    await pilot.pause(0.1)


def test_chat_screen_with_code_answer(snap_compare, dirs, tiny_model_path):
    use_settings(max_new_tokens=5)
    seed_chat("add two numbers", CODE_CHAT)
    app = NanoqwenApp(model=tiny_model_path, freeze_perf=True)

    async def run_before(pilot):
        await loaded(app, pilot)
        await send(app, pilot, "sort a list")
        await reply_done(app, pilot)
        await settle(app, pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_settings_screen(snap_compare, dirs, tiny_model_path):
    use_settings(system_prompt="You are a careful Python reviewer.")
    app = NanoqwenApp(model=tiny_model_path, freeze_perf=True)

    async def run_before(pilot):
        await loaded(app, pilot)
        await pilot.press("ctrl+s")
        await settle(app, pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_help_screen(snap_compare, dirs, tiny_model_path):
    use_settings()
    app = NanoqwenApp(model=tiny_model_path, freeze_perf=True)

    async def run_before(pilot):
        await loaded(app, pilot)
        await pilot.press("f1")
        await settle(app, pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


# Small terminals (issue 11): at 80x24 the panel fits beside the chat, at 60x20 it is folded
# to its one line; the dialogs there scroll between their title and their buttons.
SMALL = {"80x24": (80, 24), "60x20": (60, 20)}


@pytest.mark.parametrize("size", SMALL)
def test_chat_screen_small(snap_compare, dirs, tiny_model_path, size):
    use_settings(max_new_tokens=5)
    seed_chat("add two numbers", CODE_CHAT)
    app = NanoqwenApp(model=tiny_model_path, freeze_perf=True)

    async def run_before(pilot):
        await loaded(app, pilot)
        await send(app, pilot, "sort a list")
        await reply_done(app, pilot)
        await settle(app, pilot)

    assert snap_compare(app, terminal_size=SMALL[size], run_before=run_before)


@pytest.mark.parametrize("key", ["ctrl+s", "f1"])
def test_dialogs_at_60x20(snap_compare, dirs, tiny_model_path, key):
    use_settings()
    app = NanoqwenApp(model=tiny_model_path, freeze_perf=True)

    async def run_before(pilot):
        await loaded(app, pilot)
        await pilot.press(key)
        await settle(app, pilot)

    assert snap_compare(app, terminal_size=SMALL["60x20"], run_before=run_before)
