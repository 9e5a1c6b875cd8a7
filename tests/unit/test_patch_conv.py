"""The vision patch embedding as a matmul: the same outputs and gradients as the Conv3d."""

import copy

import torch
from torch import nn

from vlrft.models.loader import load_model
from vlrft.models.patch_conv import PatchwiseConv3d, use_patchwise_conv3d


def test_patchwise_conv3d_equals_the_convolution_in_value_and_gradient():
    torch.manual_seed(0)
    conv = nn.Conv3d(3, 32, kernel_size=(2, 14, 14), stride=(2, 14, 14), bias=False)
    fast = copy.deepcopy(conv)
    assert use_patchwise_conv3d(fast) == 1 and type(fast) is PatchwiseConv3d
    x = torch.randn(50, 3, 2, 14, 14)
    want, got = conv(x), fast(x)
    assert got.shape == want.shape == (50, 32, 1, 1, 1)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    want.square().sum().backward()
    got.square().sum().backward()
    torch.testing.assert_close(fast.weight.grad, conv.weight.grad, rtol=1e-4, atol=1e-4)
    bigger = torch.randn(2, 3, 4, 28, 28)  # several patches per input: the convolution itself
    torch.testing.assert_close(fast(bigger), conv(bigger))


def test_loaded_vl_model_embeds_patches_by_matmul(tiny_vl):
    model = load_model(str(tiny_vl))
    convs = [m for m in model.modules() if isinstance(m, nn.Conv3d)]
    assert convs and all(type(m) is PatchwiseConv3d for m in convs)
    assert "model.visual.patch_embed.proj.weight" in dict(model.named_parameters())  # names unchanged
