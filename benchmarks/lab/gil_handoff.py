"""What a GIL-releasing call costs a thread while another thread is busy in Python, at a
given switch interval (the app's case: the generation worker's torch ops and engine-core
calls while the UI thread paints). Times time.sleep(20 us), a blocking call without the GIL,
and a pure-Python loop, alone and next to a busy thread. CPU only; nothing here is the product.
usage: python benchmarks/lab/gil_handoff.py [--interval S] [--out FILE]
"""
import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_app

ap = argparse.ArgumentParser()
ap.add_argument("--interval", type=float, default=0.0005, help="sys.setswitchinterval, s")
ap.add_argument("--calls", type=int, default=200)
ap.add_argument("--out")
a = ap.parse_args()
sys.setswitchinterval(a.interval)


def busy(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(range(1000))


def per_call_us(f) -> float:
    times = []
    for _ in range(a.calls):
        t = time.perf_counter()
        f()
        times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


calls = {"sleep_20us (GIL released)": lambda: time.sleep(20e-6),
         "python_loop (GIL held)": lambda: sum(range(400))}
res = {}
for side in ("alone", "busy_thread"):
    stop = threading.Event()
    th = threading.Thread(target=busy, args=(stop,))
    if side == "busy_thread":
        th.start()
    for name, f in calls.items():
        res[f"{name}, {side}"] = round(per_call_us(f), 1)
    stop.set()
    if side == "busy_thread":
        th.join()
for k, v in res.items():
    print(f"{k:45s} {v:8.1f} us (median of {a.calls})")
if a.out:
    Path(a.out).write_text(json.dumps({
        "what": "GIL hand-off cost (lab/gil_handoff.py)", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "device": "CPU (this 2-core machine)", "commit": bench_app.git_commit(),
        "switch_interval_s": a.interval, "median_us": res}, indent=1))
