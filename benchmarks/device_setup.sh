# Sourced by the benchmarks/verify_*_gpu.sh scripts inside their logged block: installs the
# pinned wheels (.whl, carried) into /tmp/site and the checkout in editable mode, then builds
# and loads the extension. Needs the caller's t() (a timestamped heading).
t "install"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -3
t "build"
timeout 200 python3 -c "
import time; t=time.time()
from nanoqwen.engine.build import load_extension; print(load_extension(), f'{time.time()-t:.0f}s')" 2>&1 | tail -30
