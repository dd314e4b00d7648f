"""benchmarks/lab/app_timeline.py on the CPU with the reference backend's turns replayed at
the H200's pace: a way to try UI changes for the first text here, where the real engine's
TTFT (20-60 ms on this 2-core CPU, its per-op Python competing with the UI for the GIL) hides
what the H200 shows (the first token ~8 ms after the turn starts, while the UI still lays the
new messages out). A LAB PROBE, NOT A MEASUREMENT OF THE PRODUCT: figures from it choose what
to run on the device; only the device's figures are quoted.

A turn's key is (cached tokens, new tokens, max new tokens). The first time a key is seen the
real backend computes the turn and its tokens are recorded (bench_app's engine side runs each
turn first on even reps, so the app side replays it); afterwards the turn is replayed: the
worker sleeps (GIL released, as the CUDA worker waits in Engine.collect) $NANOQWEN_LAB_TTFT ms
(default 8) before the first token, then $NANOQWEN_LAB_STEP ms (default 2) per token, one list
per window, and kv_tokens ends as the real turn left it (the K/V tensors are not touched: every
later turn is a replay too, and `same text` in bench_app's table shows if one was not). The
app's CPU pacing of appends (CPU_ENGINE_UI_SHARE) is off, as with the CUDA engine.
$NANOQWEN_LAB_RECORD names a file that keeps the recorded turns between runs (one model file).
usage: python benchmarks/lab/gpu_paced_replay.py --backend reference [bench_app arguments]
       NANOQWEN_LAB_VARIANT=benchmarks/lab/<variant>.py adds a variant's patches first.
"""
import atexit
import os
import pickle
import runpy
import sys
import time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanoqwen.app import chat as chat_mod
from nanoqwen.engine.backends import reference
from nanoqwen.engine.backends.base import StepEvent

TTFT = float(os.environ.get("NANOQWEN_LAB_TTFT", "8")) / 1e3
STEP = float(os.environ.get("NANOQWEN_LAB_STEP", "2")) / 1e3
chat_mod.CPU_ENGINE_UI_SHARE = None
_turns: dict = {}
# $NANOQWEN_LAB_RECORD: a file the recorded turns are kept in between runs (same model file)
_record = os.environ.get("NANOQWEN_LAB_RECORD")
if _record and os.path.exists(_record):
    with open(_record, "rb") as f:
        _turns.update(pickle.load(f))
if _record:
    def _save() -> None:
        with open(_record, "wb") as f:
            pickle.dump(_turns, f)
    atexit.register(_save)
_real = reference.ReferenceBackend.generate_chunks


def generate_chunks(self, new_tokens, params, max_new_tokens, stop_ids=frozenset(),
                    cancel=None, window_s=0.03):
    key = (tuple(self.kv_tokens), tuple(new_tokens), max_new_tokens)
    rec = _turns.get(key)
    if rec is None:
        events = []
        for chunk in _real(self, new_tokens, params, max_new_tokens, stop_ids, cancel, window_s):
            events.extend(chunk)
            yield chunk
        if not (cancel is not None and cancel.is_set()):
            _turns[key] = (events, list(self.kv_tokens))
        return
    events, kv_after = rec
    base = len(self.kv_tokens) + len(new_tokens)
    # at each yield kv_tokens holds every yielded token but the last, as the real backend's
    start = time.perf_counter()
    time.sleep(TTFT)
    self.kv_tokens[:] = kv_after[:base]
    yield [StepEvent(events[0].token_id, TTFT * 1e3, True)]
    i, n = 1, max(1, int(window_s / STEP))
    while i < len(events):
        if cancel is not None and cancel.is_set():
            return
        chunk = [StepEvent(e.token_id, STEP * 1e3, False) for e in events[i:i + n]]
        # each step's token is due at start + TTFT + its index * STEP
        time.sleep(max(0.0, start + TTFT + (i + len(chunk) - 1) * STEP - time.perf_counter()))
        self.kv_tokens[:] = kv_after[:base + i + len(chunk) - 1]
        i += len(chunk)
        yield chunk


reference.ReferenceBackend.generate_chunks = generate_chunks
if os.environ.get("NANOQWEN_LAB_VARIANT"):
    runpy.run_path(os.environ["NANOQWEN_LAB_VARIANT"], run_name="lab_variant")
print(f"replaying recorded turns: TTFT {TTFT * 1e3:.1f} ms, {STEP * 1e3:.1f} ms a step",
      flush=True)
runpy.run_path(str(Path(__file__).with_name("app_timeline.py")), run_name="__main__")
