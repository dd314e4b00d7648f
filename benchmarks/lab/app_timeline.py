"""benchmarks/bench_app.py with a timeline of each app turn's first text: ms after Enter at
which the reply starts (_start_reply), the generation thread runs the service (run), the
prompt is rendered and encoded (fit), the service's batching starts (worker), the backend
is asked (chunks), the prefill is entered and has been enqueued (prefill_call, prefill_ret;
CUDA backend before 59eaa0f; from it: start_turn, the one call that starts the turn), the first token is out of the backend (chunk), the widgets are mounted, the
first text is posted by the service, handled by the chat screen, and the first append is
called and done, and the first frame made after it (bench_app's "on screen"); nm_start and
nm_end bound the new messages' frame (the first after Enter that lays the screen out); key
(negative) is when the Enter key reached the prompt, before its Submitted message's hops. Wraps the app's methods from outside; nothing here is the product.
usage: python benchmarks/lab/app_timeline.py [bench_app arguments]
"""
import sys
import time
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1]))
import bench_app
from nanoqwen.app import chat as chat_mod
from nanoqwen.app.widgets import AssistantMessage
from nanoqwen.engine import service
T = {}
def mark(k):
    T.setdefault(k, time.perf_counter())
KEY = {}
o_send = chat_mod.ChatScreen.send
async def send(self, *a, **k):
    T.clear(); mark("enter")
    if "t" in KEY:   # the Enter key reached the prompt (before the Submitted message's hops)
        T["key"] = KEY.pop("t")
    return await o_send(self, *a, **k)
chat_mod.ChatScreen.send = send
from nanoqwen.app.widgets import PromptInput
o_key = PromptInput._on_key
async def _on_key(self, event):
    if event.key == "enter":
        KEY["t"] = time.perf_counter()
    return await o_key(self, event)
PromptInput._on_key = _on_key
o_start = chat_mod.ChatScreen._start_reply
async def _start_reply(self, *a, **k):
    mark("start_reply")
    r = await o_start(self, *a, **k)
    mark("mounted")
    return r
chat_mod.ChatScreen._start_reply = _start_reply
o_run = service.EngineService._run
def _run(self, *a, **k):
    mark("run")
    yield from o_run(self, *a, **k)
service.EngineService._run = _run
from nanoqwen.engine import session as session_mod
o_fit = session_mod.ChatSession._fit
def _fit(self, *a, **k):
    r = o_fit(self, *a, **k); mark("fit"); return r
session_mod.ChatSession._fit = _fit
try:
    from nanoqwen.engine.backends import cuda as cuda_mod
    B = cuda_mod.CudaBackend
    o_gc = B.generate_chunks
    def generate_chunks(self, *a, **k):
        mark("chunks")
        g = o_gc(self, *a, **k)
        try:   # closed with the wrapper (run_turn closes it): the backend's finally runs now
            for i, c in enumerate(g):
                if i == 0: mark("chunk")
                yield c
        finally:
            g.close()
    B.generate_chunks = generate_chunks
    o_pf = B._prefill
    def _prefill(self, *a, **k):
        mark("prefill_call"); r = o_pf(self, *a, **k); mark("prefill_ret"); return r
    B._prefill = _prefill
    if hasattr(B, "_reserve_host"):   # right before start_turn (59eaa0f on)
        o_rh = B._reserve_host
        def _reserve_host(self, *a, **k):
            mark("start_turn"); return o_rh(self, *a, **k)
        B._reserve_host = _reserve_host
except ImportError:
    pass
o_batched = service.EngineService._batched
def _batched(self, events, *a, **k):
    mark("worker")
    g = o_batched(self, events, *a, **k)
    try:
        for ev in g:
            if isinstance(ev, service.Batch) and ev.text: mark("posted")
            yield ev
    finally:
        g.close()
service.EngineService._batched = _batched
o_ore = chat_mod.ChatScreen.on_reply_event
async def ore(self, m):
    if isinstance(m.event, service.Batch) and m.event.text: mark("handled")
    return await o_ore(self, m)
chat_mod.ChatScreen.on_reply_event = ore
o_app = AssistantMessage.append
def append(self, md):
    mark("append_called")
    aw = o_app(self, md)
    async def w():
        await aw; mark("append_done")
    from textual.await_complete import AwaitComplete
    return AwaitComplete(w())
AssistantMessage.append = append
if hasattr(chat_mod, "_frame_now"):
    o_fn = chat_mod._frame_now
    def _frame_now(app):
        mark("frame_now"); o_fn(app); mark("frame_now_end")
    chat_mod._frame_now = _frame_now
FF = getattr(chat_mod, "_FirstFrame", None) or chat_mod._FrameHold   # (app/ before 56423ae)
o_release = FF.release
def release(self):
    mark("released")
    return o_release(self)
FF.release = release
from textual.screen import Screen
o_tu = Screen._on_timer_update
def tu(self):
    if "enter" in T and "nm_start" not in T and "released" not in T and self._layout_required:
        # the first frame after Enter that lays the screen out: the new messages' frame
        mark("nm_start"); r = o_tu(self); mark("nm_end"); return r
    if "released" in T and "update_start" not in T:
        mark("update_start"); r = o_tu(self); mark("update_end"); return r
    return o_tu(self)
Screen._on_timer_update = tu
rows = []
o_turn = bench_app.app_turn
async def app_turn(*a, **k):
    r = await o_turn(*a, **k)
    e = T["enter"]
    row = {k: round((v - e) * 1e3, 1) for k, v in sorted(T.items(), key=lambda x: x[1])}
    row["frame"] = round(r["screen_ttft_ms"], 1) if r.get("screen_ttft_ms") else None
    row["engine_ttft"] = r.get("engine_ttft_ms"); rows.append(row)
    print("  timeline", row, flush=True)
    return r
bench_app.app_turn = app_turn
rc = bench_app.main(sys.argv[1:])
sys.exit(rc)
