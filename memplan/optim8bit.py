"""The memory layout of bitsandbytes' AdamW8bit, as a stand-in the tracer can run under fake tensors
(bitsandbytes needs a GPU and real data).

Mirrors bitsandbytes/optim/optimizer.py, Optimizer2State.init_state with optim_bits=8,
block_wise=True, min_8bit_size=4096, percentile_clipping=100, max_unorm=0:
- a parameter with fewer than 4096 elements keeps fp32 `state1` and `state2` (zeros_like);
- a larger one keeps uint8 `state1` and `state2` (one byte per element), and blockwise fp32 scales
  `absmax1`, `absmax2` of ceil(numel / 256) elements each;
- the quantization maps `qmap1`/`qmap2` (256 fp32 each) are shared by all parameters;
- `step` is a Python int. The update is one fused kernel per parameter, in place: no temporaries.
"""

from __future__ import annotations

import torch

MIN_8BIT_SIZE = 4096
BLOCKSIZE = 256
QMAP_SIZE = 256


class AdamW8bitLayout(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3) -> None:
        super().__init__(params, {"lr": lr})
        self.qmaps: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    self._init_state(p, state)
                state["step"] += 1

    def _init_state(self, p: torch.Tensor, state: dict) -> None:
        state["step"] = 0
        if p.numel() < MIN_8BIT_SIZE:
            state["state1"] = torch.zeros_like(p, dtype=torch.float32)
            state["state2"] = torch.zeros_like(p, dtype=torch.float32)
            return
        if not self.qmaps:
            self.qmaps = {name: torch.zeros(QMAP_SIZE, dtype=torch.float32, device=p.device) for name in ("dynamic", "udynamic")}
        blocks = -(-p.numel() // BLOCKSIZE)
        state["state1"] = torch.zeros_like(p, dtype=torch.uint8)
        state["qmap1"] = self.qmaps["dynamic"]
        state["state2"] = torch.zeros_like(p, dtype=torch.uint8)
        state["qmap2"] = self.qmaps["udynamic"]
        state["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
        state["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=p.device)
