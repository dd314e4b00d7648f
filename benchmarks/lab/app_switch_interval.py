"""benchmarks/lab/app_timeline.py with the app's GIL switch interval (app/main.py
GIL_SWITCH_INTERVAL, 0.5 ms) set from $NANOQWEN_LAB_SWITCH (seconds): how much of Enter ->
text is the worker getting the GIL back from a painting UI thread. Patches the app from
outside; nothing here is the product.
usage: NANOQWEN_LAB_SWITCH=0.0002 python benchmarks/lab/app_switch_interval.py [bench_app arguments]
"""
import os
import runpy
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanoqwen.app import main as app_main

app_main.GIL_SWITCH_INTERVAL = float(os.environ.get("NANOQWEN_LAB_SWITCH", "0.0002"))
print(f"GIL switch interval in the app: {app_main.GIL_SWITCH_INTERVAL * 1e3:.2f} ms", flush=True)
runpy.run_path(str(Path(__file__).with_name("app_timeline.py")), run_name="__main__")
