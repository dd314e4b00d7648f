"""A non-editable install carries what the engine needs at run time: the bundled model and the
CUDA sources it compiles at first start.

The wheel is built the way `pip install .` builds it (setuptools via pip, no isolation, no
dependencies) from a copy of the sources in tmp, so the test never writes build/ or egg-info
into the checkout and never picks up a stale build/lib. It is then installed with
`pip install --target` into tmp and used from a fresh interpreter whose working directory
is outside the checkout, with only that target ahead of the venv's site-packages: the
`nanoqwen` it imports is the installed copy (asserted), not the editable one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from nanoqwen import REPO_ROOT
from nanoqwen.engine import build

pytestmark = pytest.mark.slow

SOURCES = ("pyproject.toml", "README.md", "nanoqwen_pkg", "engine", "app", "csrc",
           "assets/tiny/tiny.nanoqwen", "assets/tiny/README.md")
MODEL = "nanoqwen/assets/tiny/tiny.nanoqwen"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    if not (REPO_ROOT / "pyproject.toml").is_file():
        pytest.skip("not a checkout")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.o")
    for rel in SOURCES:
        a, b = REPO_ROOT / rel, src / rel
        b.parent.mkdir(parents=True, exist_ok=True)
        if a.is_dir():
            shutil.copytree(a, b, ignore=ignore)
        else:
            shutil.copy2(a, b)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(src), "--no-deps",
                        "--no-build-isolation", "-q", "-w", str(tmp / "dist")],
                       capture_output=True, text=True, timeout=300, cwd=tmp)
    assert r.returncode == 0, r.stdout + r.stderr
    (whl,) = (tmp / "dist").glob("nanoqwen-*.whl")
    return whl


def test_wheel_carries_the_model_and_the_cuda_sources(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        model = z.getinfo(MODEL)
        entry_points = next(z.read(n).decode() for n in names
                            if n.endswith(".dist-info/entry_points.txt"))
    assert model.file_size == (REPO_ROOT / "assets/tiny/tiny.nanoqwen").stat().st_size
    # every file the build lists, and every source in csrc/ (a new kernel file is data too)
    wanted = set(build.SOURCES + build.HEADERS) | {
        p.name for p in (REPO_ROOT / "csrc").iterdir()
        if p.suffix in (".cu", ".cuh", ".h", ".cpp")}
    missing = sorted(n for n in wanted if f"nanoqwen/csrc/{n}" not in names)
    assert not missing, missing
    assert {f"nanoqwen/app/{p.name}" for p in (REPO_ROOT / "app").glob("*.tcss")} <= names
    assert "nanoqwen-chat = nanoqwen.app.main:main" in entry_points
    assert "nanoqwen = nanoqwen.engine.cli:main" in entry_points
    # nothing of the training recipe or the tests rides along
    assert not [n for n in names if n.startswith(("nanoqwen/assets/tiny/", "tests/"))
                and n.endswith(".py")]


PROBE = r"""
import asyncio, json, sys
from pathlib import Path
import nanoqwen
from nanoqwen.engine import build, loader
from nanoqwen.engine.service import EngineService, Batch, Finished
from nanoqwen.engine.sampling import SamplerParams
from nanoqwen.app.main import NanoqwenApp

out = {"package": nanoqwen.__file__, "checkout": nanoqwen.CHECKOUT,
       "model": str(loader.default_model_path()), "csrc": str(build.csrc_dir()),
       "build_dir": str(build.build_dir())}

async def chat():
    app = NanoqwenApp(backend="reference")  # what `nanoqwen-chat` runs, headless
    async with app.run_test(size=(100, 30)) as pilot:
        for _ in range(3000):
            if app.engine is not None:
                break
            await pilot.pause(0.02)
        info = app.engine.info
        out["app_model"], out["app_name"] = str(info.path), info.name
        text = ""
        for ev in app.engine.submit([], "def add(a, b):", SamplerParams.greedy_params(), 8):
            if isinstance(ev, Batch):
                text += ev.text
        out["reply"] = text

asyncio.run(chat())
print(json.dumps(out))
"""


def test_an_installed_copy_finds_its_model_and_csrc(wheel, tmp_path):
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target",
                        str(site), str(wheel)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (site / "bin" / "nanoqwen-chat").is_file()
    env = dict(os.environ, PYTHONPATH=str(site), XDG_CONFIG_HOME=str(tmp_path / "config"),
               XDG_DATA_HOME=str(tmp_path / "data"), XDG_CACHE_HOME=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    pkg = site / "nanoqwen"
    assert Path(out["package"]) == pkg / "__init__.py" and out["checkout"] is False
    assert Path(out["model"]) == pkg / "assets" / "tiny" / "tiny.nanoqwen"
    assert Path(out["csrc"]) == pkg / "csrc"
    for name in build.SOURCES + build.HEADERS:  # what load_extension() compiles
        assert (pkg / "csrc" / name).is_file(), name
    assert Path(out["build_dir"]).parent == tmp_path / "cache" / "nanoqwen"
    assert out["app_model"] == out["model"] and out["app_name"] == "nanoqwen-tiny-coder-30m"
    assert out["reply"], out
    print(json.dumps(out, indent=1))


def test_the_checkout_resolves_to_itself():
    import nanoqwen
    from nanoqwen.engine import loader
    assert nanoqwen.CHECKOUT and nanoqwen.REPO_ROOT == Path(__file__).resolve().parents[1]
    assert loader.default_model_path() == REPO_ROOT / "assets" / "tiny" / "tiny.nanoqwen"
    assert build.csrc_dir() == REPO_ROOT / "csrc" or "NANOQWEN_CSRC" in os.environ
