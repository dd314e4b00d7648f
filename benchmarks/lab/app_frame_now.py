"""benchmarks/bench_app.py with the app's first-text frame made differently (a lab variant of
chat._FrameHold, patched in from outside; nothing here is the product): no hold, so the
frame that shows the new messages is made while the engine prefills, and once the first text
is in its widget (it fills the empty paragraph's line without a reflow since d22d713) the
screen update runs at once instead of at the next 1/60 s slot of Textual's update timer. The
perf panel and title still wait for the frame after the first text, collections still pause.
Runs lab/app_timeline.py (bench_app with each first text's timeline) with this in place.
usage: python benchmarks/lab/app_frame_now.py [bench_app arguments]
"""
import asyncio
import runpy
import sys
from functools import partial
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanoqwen.app import chat, heap


class FrameNow:
    def __init__(self, app, stream, after=()) -> None:
        self._app = app
        self._after = list(after) + [partial(heap.resume, heap.pause())]
        self._done = False
        self._timer = app.set_timer(chat.FIRST_FRAME_HOLD, self.release, name="first-frame")
        self._task = asyncio.ensure_future(self._until_text(stream))

    async def _until_text(self, stream) -> None:
        await stream.first_append.wait()
        self.release()
        if not self._app._batch_count:
            self._app.screen._on_timer_update()   # the frame now, not at the timer's next slot

    def release(self) -> None:
        if not self._done:
            self._done = True
            self._timer.stop()
            self._task.cancel()
            for callback in self._after:
                self._app.call_after_refresh(callback)


chat._FrameHold = FrameNow   # before app_timeline wraps chat._FrameHold.release
runpy.run_path(str(Path(__file__).with_name("app_timeline.py")), run_name="__main__")
