"""nanoqwen: a local Qwen2.5-Coder chat app with its own CUDA decode engine.

The source folders (engine/, app/) are mapped into this one namespace by pyproject's
package-dir, so nothing installs a generic top-level name.

`REPO_ROOT` is the directory that holds `assets/` (the bundled model) and `csrc/` (the CUDA
sources the engine builds at first start):
- run from a checkout (editable install, or tests): the checkout, where this file is
  nanoqwen_pkg/__init__.py;
- installed (`pip install .`): this package's own directory, site-packages/nanoqwen/, where
  pyproject installs assets/tiny/tiny.nanoqwen and csrc/* as package data (nanoqwen.assets,
  nanoqwen.csrc).
The name says "repo" because everything that looks for those two folders joins onto it.
"""

from pathlib import Path

__version__ = "0.1.0"

_HERE = Path(__file__).resolve().parent
CHECKOUT = _HERE.name == "nanoqwen_pkg"  # installed copies live in a folder named nanoqwen
REPO_ROOT = _HERE.parent if CHECKOUT else _HERE
