"""Garbage-collection pauses during benchmarks/bench_app.py turns: every collection's generation
and duration, when it began after the latest Enter, and the objects the collector tracks at each
Enter. `--no-heap-policy` turns app/heap.py's rules off (no freeze after the load, no pause from
Enter to the first frame), as the app was before them. Other arguments go to bench_app.

    .venv/bin/python benchmarks/lab/gc_pauses.py [--no-heap-policy] --gc-json F --reps 2 --tokens 256 --quiet
"""
import gc
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_app  # noqa: E402
from nanoqwen.app import chat as chat_mod, heap  # noqa: E402

argv = sys.argv[1:]
policy = "--no-heap-policy" not in argv
argv = [a for a in argv if a != "--no-heap-policy"]
out = None
if "--gc-json" in argv:
    i = argv.index("--gc-json")
    out = argv[i + 1]
    del argv[i:i + 2]
if not policy:
    heap.settle = lambda: None
    heap.pause = lambda: False
    heap.collect_soon = lambda app: None

enters, collections, start = [], [], {}
o_send = chat_mod.ChatScreen.send


async def send(self, text):
    enters.append(dict(t=time.perf_counter(), tracked=len(gc.get_objects())))
    return await o_send(self, text)
chat_mod.ChatScreen.send = send


def callback(phase, info):
    now = time.perf_counter()
    if phase == "start":
        start["t"] = now
    elif enters:
        collections.append(dict(generation=info["generation"], collected=info["collected"],
                                ms=(now - start["t"]) * 1e3,
                                after_enter_ms=(start["t"] - enters[-1]["t"]) * 1e3))
gc.callbacks.append(callback)
rc = bench_app.main(argv)
full = [c for c in collections if c["generation"] == 2]
summary = dict(heap_policy=policy, enters=len(enters),
               tracked_at_enter=[e["tracked"] for e in enters],
               full_collections_ms=[round(c["ms"], 1) for c in full],
               full_collections_after_enter_ms=[round(c["after_enter_ms"]) for c in full],
               full_within_100ms_of_enter=sum(c["after_enter_ms"] < 100 for c in full))
print(summary)
if out:
    Path(out).write_text(json.dumps(dict(commit=bench_app.git_commit(), summary=summary,
                                         collections=collections), indent=1))
sys.exit(rc)
