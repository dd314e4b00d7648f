"""The UI thread's CPU time per turn of benchmarks/bench_app.py on the CPU (time.thread_time
in the event loop's thread, Enter to the whole reply on screen), with the frames and appends
of each turn: what an engine on the CPU loses to the UI (widgets.CPU_ENGINE_UI_SHARE). A LAB
PROBE for choosing the app's CPU pacing; bench_app's turn ratio is the product figure.

NANOQWEN_LAB_OLD_PACING=1 puts back the pacing before session 14 (PAINT_INTERVAL_MAX 0.25 s,
the perf panel's CPU interval 0.2 s) for the A/B. NANOQWEN_LAB_REPLAY=1 replays the turns
(lab/gpu_paced_replay.py's recorder; NANOQWEN_LAB_TTFT / _STEP set the pace, e.g. 35 and 11
for the bundled model on 2 cores) with the CPU pacing kept: the UI's cost without the engine's
contention, which moves this machine's figures less. Writes bench_app's JSON (--json) with
ui_cpu_ms and ui_frames in each app turn's row and their medians in the summary.
usage: python benchmarks/lab/ui_cpu_per_turn.py --tokens 256 --reps 3 --quiet --json F
"""
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if os.environ.get("NANOQWEN_LAB_REPLAY") == "1":   # the recorder's patch, not its main
    _src = Path(__file__).with_name("gpu_paced_replay.py").read_text()
    _src = _src.split('if os.environ.get("NANOQWEN_LAB_VARIANT")')[0]
    exec(compile(_src.replace("Path(__file__)", f"Path({str(Path(__file__))!r})"),
                 "gpu_paced_replay.py", "exec"))
import bench_app  # noqa: E402
from nanoqwen.app import chat as chat_mod, perf as perf_mod, widgets  # noqa: E402

chat_mod.CPU_ENGINE_UI_SHARE = widgets.CPU_ENGINE_UI_SHARE   # the replay turns it off
if os.environ.get("NANOQWEN_LAB_OLD_PACING") == "1":
    widgets.PAINT_INTERVAL_MAX = 0.25
    perf_mod.REDRAW_INTERVAL_CPU = perf_mod.REDRAW_INTERVAL

_turn = bench_app.app_turn


async def app_turn(app, clock, text, timeout):
    """bench_app's app turn, with the UI thread's CPU time and frames in its row."""
    n_frames, cpu = len(clock.frames), time.thread_time()
    r = await _turn(app, clock, text, timeout)
    r.update(ui_cpu_ms=(time.thread_time() - cpu) * 1e3, ui_frames=len(clock.frames) - n_frames)
    return r


bench_app.app_turn = app_turn
_summarize = bench_app.summarize


def summarize(turns):
    out = _summarize(turns)
    lab = dict(old_pacing=os.environ.get("NANOQWEN_LAB_OLD_PACING") == "1",
               replay=os.environ.get("NANOQWEN_LAB_REPLAY") == "1",
               ttft_ms=os.environ.get("NANOQWEN_LAB_TTFT"),
               step_ms=os.environ.get("NANOQWEN_LAB_STEP"))
    for case, s in out.items():
        rows = [t for t in turns if t["case"] == case and t["side"] == "app" and not t["warmup"]]
        for k in ("ui_cpu_ms", "ui_frames", "appends"):
            s[k] = statistics.median(t[k] for t in rows) if rows else None
        s["lab"] = lab
        print(f"{case}: UI thread CPU {s['ui_cpu_ms']:.0f} ms a turn (median), "
              f"{s['ui_frames']} frames, {s['appends']} appends; {lab}")
    return out


bench_app.summarize = summarize
sys.exit(bench_app.main())
