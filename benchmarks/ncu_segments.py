"""The decode step's segment kernels (csrc/decode_segment.cu) on a model of a preset's shapes cut to
two layers (random weights), eager steps, for Nsight Compute:

    NANOQWEN_DECODE_SEGMENTS=1 ncu --clock-control none --kernel-name regex:decode_segment \\
        --launch-skip 4 --launch-count 1 --section SpeedOfLight --section WarpStateStats \\
        --section MemoryWorkloadAnalysis --section SourceCounters python3 benchmarks/ncu_segments.py 7b

Each decode step launches segments 0 (embedding, RMSNorm, q/k/v of layer 0), 1 (layer 0's o,
RMSNorm, gate/up, down, then layer 1's RMSNorm and q/k/v: a whole layer's weights) and 2 (layer 1's
tail); the prompt's prefill launches none. --launch-skip 4 lands on the second step's segment 1.
benchmarks/ncu_gemv.py profiles the chain's four GEMVs at the 7B shapes for comparison.
"""

from __future__ import annotations

import sys

import torch


def main() -> None:
    from nanoqwen.engine.backends.cuda import CudaBackend
    from nanoqwen.engine.config import PRESETS, ModelConfig
    from nanoqwen.engine.synthetic import SyntheticWeights

    preset = sys.argv[1] if len(sys.argv) > 1 else "7b"
    cfg = ModelConfig(name=f"{preset}-shapes-2-layers",
                      **{**PRESETS[preset], "num_hidden_layers": 2})
    be = CudaBackend(cfg, SyntheticWeights(cfg, 0, device="cuda"), max_context=512)
    print("decode_segments:", be.switches.decode_segments)
    be.mode = "eager"
    be.forward(list(range(3, 20)))
    for t in range(20, 24):
        be.forward([t])
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
