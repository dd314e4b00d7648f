"""The frame that shows a turn's new messages: the first screen update after Enter that lays
the screen out (the update timer's tick after the mount). On the H200 the first text is posted
~10 ms after Enter and waits for this frame, 8-19 ms there (RESULTS.md, session 12). Per
bench_app turn after the warm-up: its wall time; inside it the reflow (Compositor.reflow) and
the render (Compositor.render_update) and each widget class's render_lines; the region it
rendered (the union of the reflow's dirty regions) and the widgets dirty before it. Wraps the
app from outside; nothing here is the product.
usage: python benchmarks/lab/new_messages_frame.py [--out FILE] [bench_app arguments]
"""
import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_app
from nanoqwen.app import chat as chat_mod
from textual._compositor import Compositor
from textual.geometry import Region
from textual.screen import Screen
from textual.widget import Widget

ap = argparse.ArgumentParser(add_help=False)
ap.add_argument("--out")
args, rest = ap.parse_known_args()

S = {"armed": False, "n": 0, "in": False}
cur: dict = {}
frames: list[dict] = []
o_send = chat_mod.ChatScreen.send


async def send(self, text, after=()):
    S["n"] += 1
    S["armed"] = S["n"] > 2          # bench_app's warm-up turns first
    S["case"] = "new_chat" if S["n"] % 2 else "next_turn"   # bench_app's turns alternate
    return await o_send(self, text, after)
chat_mod.ChatScreen.send = send


def timed(cls, name, key):
    o = getattr(cls, name)

    def f(*a, **k):
        if not S["in"]:
            return o(*a, **k)
        t = time.perf_counter()
        r = o(*a, **k)
        kk = key(a) if callable(key) else key
        cur[kk] = cur.get(kk, 0.0) + (time.perf_counter() - t) * 1e3
        return r
    setattr(cls, name, f)


timed(Compositor, "reflow", "reflow_ms")
timed(Widget, "render_lines", lambda a: "render_lines_ms:" + type(a[0]).__name__)
o_ru = Compositor.render_update


def render_update(self, full=False, screen_stack=None, simplify=False):
    if not S["in"]:
        return o_ru(self, full, screen_stack, simplify)
    dirty = list(self._dirty_regions)
    crop = Region.from_union(dirty).intersection(self.size.region) if dirty else None
    cur["screen"] = [self.size.width, self.size.height]
    cur["crop"] = [crop.x, crop.y, crop.width, crop.height] if crop else None
    t = time.perf_counter()
    r = o_ru(self, full, screen_stack, simplify)
    cur["render_ms"] = cur.get("render_ms", 0.0) + (time.perf_counter() - t) * 1e3
    return r
Compositor.render_update = render_update
o_tu = Screen._on_timer_update


def tu(self):
    if S["armed"] and self._layout_required:
        S["armed"] = False
        cur.clear()
        cur["case"] = S["case"]
        cur["dirty_before"] = sorted(type(w).__name__ for w in self._dirty_widgets)
        S["in"] = True
        t = time.perf_counter()
        r = o_tu(self)
        S["in"] = False
        cur["frame_ms"] = (time.perf_counter() - t) * 1e3
        frames.append(dict(cur))
        return r
    return o_tu(self)
Screen._on_timer_update = tu

rc = bench_app.main(rest)
tops = {}
for case in ("new_chat", "next_turn"):
    fs = [f for f in frames if f["case"] == case]
    keys = collections.Counter(k for f in fs for k, v in f.items() if isinstance(v, float))
    med = {k: round(statistics.median(f.get(k, 0.0) for f in fs), 2) for k in keys}
    top = tops[case] = dict(sorted(med.items(), key=lambda kv: -kv[1]))
    print(f"new messages' frame, {case}: {len(fs)} turns; medians, ms:")
    for k, v in list(top.items())[:12]:
        print(f"  {k:45s} {v:6.2f}")
    if fs:
        print("  regions rendered:", sorted({tuple(f['crop']) for f in fs if f.get('crop')}),
              "of", fs[0].get("screen"))
if args.out:
    Path(args.out).write_text(json.dumps({
        "what": "the new messages' frame (lab/new_messages_frame.py)",
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "commit": bench_app.git_commit(),
        "args": rest, "medians_ms": tops, "frames": frames}, indent=1))
sys.exit(rc)
