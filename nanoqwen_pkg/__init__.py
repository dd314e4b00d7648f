"""nanoqwen: a local Qwen2.5-Coder chat app with its own CUDA decode engine.

The source folders (engine/, app/) are mapped into this one namespace by pyproject's
package-dir, so nothing installs a generic top-level name.
"""

from pathlib import Path

__version__ = "0.1.0"

# The repository root when installed editable; csrc/ and assets/ live there.
REPO_ROOT = Path(__file__).resolve().parent.parent
