# Sourced first by the benchmarks/verify_*_gpu.sh scripts that return a results tarball: strict
# pipes, $OUT and its results folder $R, the clock and t() (a timestamped heading), the commit $C
# (NANOQWEN_COMMIT: the device's copy has no .git) and the part $P (PART, default A).
set -o pipefail
export PYTHONUNBUFFERED=1 MAX_JOBS=16
OUT=${OUT:-/tmp/out}; R="$OUT/r"; mkdir -p "$R"
S=$(date +%s)
t() { echo "[$(( $(date +%s) - S ))s] == $*"; }
C=${NANOQWEN_COMMIT:-unknown}
P=${PART:-A}
