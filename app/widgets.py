"""Widgets of the chat screen: the prompt, the two kinds of message, copyable code blocks.

Code blocks are Textual's MarkdownFence (highlighted with Pygments through
textual.highlight), subclassed only to copy their code on click.
"""

from __future__ import annotations

from textual import events
from textual.message import Message
from textual.widgets import Markdown, Static, TextArea
from textual.widgets._markdown import MarkdownFence  # the class Markdown.BLOCKS maps fences to

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
    terminals cannot tell Shift+Enter from Enter, Ctrl+J always arrives as its own key)."""

    class Submitted(Message):
        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self.text))
            return
        if event.key in ("shift+enter", "ctrl+j"):
            event.stop()
            event.prevent_default()
            if not self.read_only:
                start, end = self.selection
                self.replace("\n", start, end, maintain_selection_offset=False)
            return
        await super()._on_key(event)


class UserMessage(Static):
    def __init__(self, text: str, msg_id: int | None = None) -> None:
        super().__init__(text, markup=False, classes="message user")
        self.msg_id = msg_id
        self.border_title = "You"


class CodeFence(MarkdownFence):
    """A highlighted code block; a click copies its code to the clipboard."""

    def on_click(self, event: events.Click) -> None:
        event.stop()
        self.app.copy_code(self.code)  # type: ignore[attr-defined]


class AssistantMessage(Markdown):
    """A reply, rendered as Markdown. Streaming goes through `Markdown.get_stream`."""

    BLOCKS = {**Markdown.BLOCKS, "fence": CodeFence, "code_block": CodeFence}

    def __init__(self, text: str = "", msg_id: int | None = None,
                 finish: str | None = "stop") -> None:
        super().__init__(text, classes="message assistant", open_links=False)
        self.msg_id = msg_id
        self.border_title = "Assistant"
        self.set_finish(finish)

    def set_finish(self, finish: str | None, streaming: bool = False) -> None:
        """The note under the reply: how it ended, or that it is still streaming."""
        if streaming:
            self.border_subtitle = "streaming… (esc stops)"
        else:
            note = FINISH_NOTES.get(finish, finish)
            self.border_subtitle = note or ""
        self.set_class(streaming, "-streaming")
