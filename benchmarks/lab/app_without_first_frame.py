"""benchmarks/bench_app.py with the app's first-frame changes of fcbc746 turned off: no
_FrameHold, now chat._FirstFrame (no GC pause, the first text's frame at the timer's tick,
the panel and title at once) and no open_block (the first text mounts its block). The same app otherwise, the same clock (first
frame after an append), so the two runs side by side show what those changes bought.
Patches the app from outside; nothing here is the product.
usage: python benchmarks/lab/app_without_first_frame.py [bench_app arguments]
"""
import sys
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
import bench_app
from nanoqwen.app import chat
from nanoqwen.app.widgets import AssistantMessage


class NoHold:
    def __init__(self, app, stream, after=()) -> None:
        for callback in after:
            callback()


async def no_open_block(self) -> None:
    pass

chat._FirstFrame = NoHold
AssistantMessage.open_block = no_open_block
sys.exit(bench_app.main(sys.argv[1:]))
