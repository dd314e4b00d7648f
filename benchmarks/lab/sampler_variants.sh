#!/usr/bin/env bash
# Build csrc/ variants of sampling.cu (sed edits of a copy; nothing here is the product) and
# time each with sampler_variants.py. usage: bash benchmarks/lab/sampler_variants.sh (on the device,
# after the extension's dependencies are installed); output: JSON lines on stdout.
set -o pipefail
V=(
  "current|"
  "inline|s/__device__ __noinline__ /__device__ /"
  "inline_noband|s/__device__ __noinline__ /__device__ /;s/constexpr int kBandCap = 8192;/constexpr int kBandCap = 0;/"
)
for v in "${V[@]}"; do
  name=${v%%|*}; edit=${v#*|}
  d=/tmp/csrc_$name; rm -rf $d; cp -r csrc $d
  [ -n "$edit" ] && sed -i "$edit" $d/sampling.cu
  VARIANT=$name NANOQWEN_CSRC=$d timeout 240 python3 benchmarks/lab/sampler_variants.py 2>&1 | grep '^{' || echo "{\"variant\": \"$name\", \"error\": true}"
done
