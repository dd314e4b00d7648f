#!/usr/bin/env bash
# The whole recipe, one command: data -> tokenizer -> train (time-boxed) -> INT4 export.
#   assets/tiny/run.sh OUT_DIR [WORK_DIR]          (on a CUDA machine; ~9 minutes on one H200)
#   NQ_SMOKE=1 assets/tiny/run.sh OUT_DIR          (CPU smoke test: micro model, few files)
# NQ_BUDGET (seconds, default 540): the whole run ends by then; training takes what is left.
# The seed is fixed (1234) in every stage; results vary only with the installed Python files.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="${1:?usage: run.sh OUT_DIR [WORK_DIR]}"
work="${2:-/tmp/nanoqwen-tiny-work}"
mkdir -p "$out" "$work"
export PYTHONUNBUFFERED=1 NQ_DEADLINE=$(( $(date +%s) + ${NQ_BUDGET:-540} ))
py=${PYTHON:-python3}
if [ -n "${NQ_SMOKE:-}" ]; then
  $py "$here/build_data.py" --out "$work" --max-files 400 --n-requests 20
  $py "$here/train_tokenizer.py" --data "$work" --out "$work" --vocab-size 1024 --sample-mb 2
  $py "$here/train.py" --work "$work" --shapes micro --seq-len 256 --batch 8 --max-steps 30 \
      --warmup 10 --lr 3e-3 --eval-windows 16 --compile ${NQ_SMOKE_COMPILE:-0} --train-seconds 120
  $py "$here/export.py" --work "$work" --out "$out" --samples 2 --max-new 24
else
  $py "$here/build_data.py" --out "$work"
  $py "$here/train_tokenizer.py" --data "$work" --out "$work"
  $py "$here/train.py" --work "$work"
  $py "$here/export.py" --work "$work" --out "$out"
fi
cp "$work/heldout_requests.json" "$work/data_stats.json" "$out/"
sha256sum "$out/tiny.nanoqwen" | tee "$out/tiny.nanoqwen.sha256"
if [ -n "${NQ_SPLIT:-}" ]; then  # the GPU machine returns files of at most 16 MiB
  mv "$out/tiny.nanoqwen" "$work/tiny.nanoqwen"
  split -b 15M "$work/tiny.nanoqwen" "$out/tiny.nanoqwen.part-"
  ls -l "$out"
fi
