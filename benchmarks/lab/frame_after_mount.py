"""The frame after a message is mounted into an open chat of N stored exchanges (no engine
work): what every Enter and every block a streamed reply adds pays for the reflow of all the
mounted widgets. Headless app (`App.run_test`), temp config/data dirs, the bundled model loaded
(so the app is as in use), each exchange ~30 lines of Markdown with a code block; per
repetition one UserMessage is mounted and the slowest screen update after it is timed.
Measures chat.CHAT_WINDOW's effect (`--window 1000`: every message mounted, as before it).

    .venv/bin/python benchmarks/lab/frame_after_mount.py --exchanges 10 40 --window 20 1000 --json F
"""
import argparse
import asyncio
import datetime as _dt
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
REPLY = ("Here is the class:\n\n```python\n"
         + "\n".join(f"def f{i}(x):\n    return x + {i}" for i in range(20))
         + "\n```\n\nIt works like this: " + "word " * 80 + "\n\n- one\n- two\n- three\n")


async def measure(n: int, window: int, reps: int) -> dict:
    from textual.screen import Screen
    from nanoqwen.app import chat as chat_mod
    from nanoqwen.app.main import NanoqwenApp
    from nanoqwen.app.widgets import UserMessage

    chat_mod.CHAT_WINDOW = window
    ups, on = [], [False]
    orig = Screen._on_timer_update

    def timed(self):
        t = time.perf_counter()
        r = orig(self)
        if on[0] and self.is_current:
            ups.append((time.perf_counter() - t) * 1e3)
        return r
    Screen._on_timer_update = timed
    try:
        app = NanoqwenApp(threads=1)
        async with app.run_test(size=(120, 40)):
            while app.engine is None:
                await asyncio.sleep(0.05)
            s = app.store
            cid = s.new_chat("long", "m", None)
            for i in range(n):
                s.add_message(cid, "user", f"question {i}")
                s.add_message(cid, "assistant", REPLY, finish="stop")
            app.chat.open_chat(cid)
            await asyncio.sleep(2.0)
            box = app.chat.query_one("#messages")
            frames = []
            for rep in range(reps):
                ups.clear()
                on[0] = True
                await box.mount(UserMessage(f"new {rep}"))
                box.scroll_end(animate=False)
                await asyncio.sleep(0.3)
                on[0] = False
                frames.append(max(ups))
            return dict(exchanges=n, window=window, widgets=len(list(app.chat.query("*"))),
                        frame_ms=frames)
    finally:
        Screen._on_timer_update = orig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--exchanges", type=int, nargs="+", default=[10, 40])
    ap.add_argument("--window", type=int, nargs="+", default=[20, 1000])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", metavar="FILE")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp()
    os.environ["XDG_CONFIG_HOME"], os.environ["XDG_DATA_HOME"] = tmp + "/c", tmp + "/d"
    from bench_app import git_commit

    rows = []
    for n in args.exchanges:
        for w in args.window:
            r = asyncio.run(measure(n, w, args.reps))
            print(r, flush=True)
            rows.append(r)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(
            date=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            commit=git_commit(), device=platform.processor() or platform.machine(),
            cpu_count=os.cpu_count(), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
