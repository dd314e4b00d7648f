"""benchmarks/lab/app_timeline.py with the prompt emptied after the reply's first text's
frame instead of at Enter: how much of the new messages' frame (the first after Enter that
lays the screen out, which the first text waits for on the H200) is the prompt's repaint
(the TextArea's render, and the rows between the new messages and the prompt that the
frame's region then spans). Patches the app from outside; nothing here is the product.
usage: python benchmarks/lab/prompt_after_first_text.py [bench_app arguments]
"""
import asyncio
import runpy
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanoqwen.app.widgets import PromptInput

_clear = PromptInput.clear


def clear(self):
    reply = getattr(self.screen, "reply", None)
    if reply is None or reply.stream.first_append.is_set():
        return _clear(self)

    async def later() -> None:
        await reply.stream.first_append.wait()
        await asyncio.sleep(0)
        self.call_after_refresh(lambda: _clear(self))
    asyncio.ensure_future(later())


PromptInput.clear = clear
runpy.run_path(str(Path(__file__).with_name("app_timeline.py")), run_name="__main__")
