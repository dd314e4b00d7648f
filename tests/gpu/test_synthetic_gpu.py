"""SyntheticWeights on the GPU (what `nanoqwen bench --synthetic` loads) give the very bits it
gives on the CPU (what `nanoqwen convert --synthetic` writes): engine/synthetic.py says why."""

from __future__ import annotations

import pytest
import torch

from nanoqwen.engine.config import PRESETS, ModelConfig
from nanoqwen.engine.synthetic import SyntheticWeights

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# 0.5B shapes, one layer: the embedding spans several GPU blocks, k = 896 and 4864
ONE_LAYER = ModelConfig(name="0.5b-1-layer", **{**PRESETS["0.5b"], "num_hidden_layers": 1})


def test_gpu_and_cpu_make_the_same_tensors():
    cpu = SyntheticWeights(ONE_LAYER, seed=11, device="cpu")
    gpu = SyntheticWeights(ONE_LAYER, seed=11, device="cuda", block_elems=1 << 24)
    for name in cpu:
        g = gpu[name]
        assert g.device.type == "cuda", name
        assert torch.equal(g.cpu(), cpu[name]), name
