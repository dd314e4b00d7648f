"""benchmarks/lab/app_timeline.py with Textual's own partial frames (app/frames.py not
installed): every widget whose clip overlaps a frame's region is rendered for it, as before
frames.py. The A/B of that change in one device session. Patches the app from outside;
nothing here is the product.
usage: python benchmarks/lab/app_textual_renders.py [bench_app arguments]
"""
import runpy
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanoqwen.app import frames

frames.install = lambda: None
runpy.run_path(str(Path(__file__).with_name("app_timeline.py")), run_name="__main__")
