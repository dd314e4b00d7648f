"""UI-thread CPU time (time.thread_time) per phase from Enter to the end of the first text's screen update, per bench_app turn (after the warm-up): _start_reply (with any mount), until the hold's release, the frame, and inside them Stylesheet.apply, the reflow, the render and each widget class's render_lines. Wraps the app from outside; nothing here is the product. usage: python benchmarks/lab/ui_cpu_first_frame.py [bench_app arguments]"""
import sys, time, collections
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
import bench_app
from nanoqwen.app import chat as chat_mod
from nanoqwen.app.widgets import AssistantMessage
from textual.screen import Screen
from textual.widget import Widget
from textual._compositor import Compositor
from textual.css.stylesheet import Stylesheet
S = {"on": False, "rel": False, "n": 0}
acc = collections.defaultdict(float)
cnt = collections.Counter()
rows = []
def wrap(cls, name, key, only_frame=False):
    o = getattr(cls, name)
    def f(*a, **k):
        if not S["on"] or (only_frame and not S["rel"]):
            return o(*a, **k)
        t = time.thread_time(); r = o(*a, **k); dt = time.thread_time() - t
        kk = key(a) if callable(key) else key
        acc[kk] += dt; cnt[kk] += 1
        return r
    setattr(cls, name, f)
wrap(Widget, "render_lines", lambda a: "render:" + type(a[0]).__name__)
wrap(Compositor, "reflow", "reflow")
wrap(Compositor, "render_update", "render_update")
wrap(Stylesheet, "apply", "css_apply")
wrap(Stylesheet, "update_nodes", "css_update_nodes")
o_send = chat_mod.ChatScreen.send
async def send(self, text):
    S["n"] += 1
    if S["n"] > 2:
        S["on"] = True; S["rel"] = False; acc.clear(); cnt.clear(); S["t0"] = time.thread_time()
    return await o_send(self, text)
chat_mod.ChatScreen.send = send
o_start = chat_mod.ChatScreen._start_reply
async def _start_reply(self, *a, **k):
    t = time.thread_time(); r = await o_start(self, *a, **k)
    if S["on"]: acc["_start_reply(incl mount)"] += time.thread_time() - t
    return r
chat_mod.ChatScreen._start_reply = _start_reply
o_app = AssistantMessage.append
def append(self, md):
    if S["on"] and "append_at" not in S: S["append_at"] = time.thread_time() - S["t0"]
    return o_app(self, md)
AssistantMessage.append = append
FF = getattr(chat_mod, "_FirstFrame", None) or chat_mod._FrameHold   # (app/ before 56423ae)
o_release = FF.release
def release(self):
    S["rel"] = True
    if S["on"]: acc["until_release"] = time.thread_time() - S["t0"]
    return o_release(self)
FF.release = release
o_tu = Screen._on_timer_update
def tu(self):
    if S["on"] and S["rel"]:
        t = time.thread_time(); r = o_tu(self); acc["frame_update"] += time.thread_time() - t
        acc["total"] = time.thread_time() - S["t0"]
        S["on"] = False; S.pop("append_at", None)
        rows.append({k: (round(v * 1e3, 2), cnt[k]) for k, v in sorted(acc.items(), key=lambda x: -x[1])})
        return r
    return o_tu(self)
Screen._on_timer_update = tu
rc = bench_app.main(sys.argv[1:])
for r in rows: print(r)
