"""Patch embeddings as a matmul. Qwen-VL's vision tower embeds each 2x14x14 patch with a Conv3d
whose kernel and stride equal the patch: one output per input, i.e. a matrix product with the
flattened kernel. The convolution kernels do the same product slower (on the CPU the patch
embedding's forward and backward took about 10% of a demo update's operator time as a conv;
the update ran 6-11% faster as a matmul, same process, alternating), so `PatchwiseConv3d`
computes it as `x @ W^T`. Same parameter, same name and
shape (checkpoints, engines and ZeRO-3's per-module gathering see an ordinary Conv3d), same
numbers up to float summation order.
"""

from __future__ import annotations

import torch
from torch import nn


class PatchwiseConv3d(nn.Conv3d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        single_patch = (
            x.dim() == 5 and tuple(x.shape[2:]) == tuple(self.kernel_size) and self.groups == 1
            and self.padding in ((0, 0, 0), "valid") and tuple(self.dilation) == (1, 1, 1)
        )
        if not single_patch:
            return super().forward(x)
        n = x.shape[0]
        out = nn.functional.linear(x.reshape(n, -1), self.weight.reshape(self.out_channels, -1), self.bias)  # [N, out]
        return out.reshape(n, self.out_channels, 1, 1, 1)


def use_patchwise_conv3d(model: nn.Module) -> int:
    """Turn the model's patchifying Conv3d layers (kernel == stride) into `PatchwiseConv3d`, in
    place. Returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is nn.Conv3d and tuple(module.kernel_size) == tuple(module.stride):
            module.__class__ = PatchwiseConv3d
            count += 1
    return count
