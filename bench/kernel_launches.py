"""Kernel launches per micro-batch of vlrft's policy update, counted on a CPU: the aten ops one
packed micro-batch's forward and backward dispatch, views left out (on a GPU each of the rest
launches a kernel or more). When the GPU is seldom busy (bench/gpu_step.py's profile line), the
update's time is these launches: their number is what to cut.

    python bench/kernel_launches.py                      # 1.5B depths, ZeRO-2, checkpointing on
    python bench/kernel_launches.py --shape 3B --checkpointing off

The model is bench/gpu_step.py's Qwen2.5-VL shape at its depths (28 decoder layers for the
1.5B, the 32-layer vision tower) with tiny widths: the count depends on depth, not width. One
text micro-batch (4 rollouts of the bench's lengths, bf16 compute) under vlrft's DeepSpeed
backend, with the vision tower declared for: images and videos (a run whose data holds both;
before 2026-11-26, every run), images (image data: a text micro-batch runs a dummy image, an
image one its images), nothing (text data). Then, under ZeRO-2, text data once more with the
weights in bf16 (DeepSpeed's bf16 mode, as under ZeRO-3; `gpu_step.py --weights bf16`): no
per-matmul casts of fp32 weights.
"""

from __future__ import annotations

import argparse
import collections
import runpy
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

GPU_STEP = runpy.run_path(str(Path(__file__).with_name("gpu_step.py")))

# Ops that make a view, a shape or an empty tensor: no kernel on a GPU.
NO_KERNEL = {"view", "_unsafe_view", "as_strided", "t", "transpose", "permute", "slice", "select", "narrow",
             "unsqueeze", "squeeze", "expand", "detach", "alias", "split", "split_with_sizes", "unbind", "view_as",
             "reshape", "_reshape_alias", "lift_fresh", "empty", "empty_strided", "new_empty", "new_empty_strided",
             "resolve_conj", "resolve_neg", "_has_compatible_shallow_copy_type", "is_same_size", "set_"}


class LaunchCount(TorchDispatchMode):
    """Counts the dispatched aten ops that launch a kernel on a GPU, by name."""

    def __init__(self):
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in NO_KERNEL:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))

    def total(self) -> int:
        return sum(self.counts.values())


def launches(shape: str, zero: int, checkpointing: bool, modalities: tuple[str, ...],
             bf16_weights: bool = False) -> tuple[int, int]:
    """(forward, backward) launches of one text micro-batch's update, the tower declared for `modalities`."""
    from vlrft.backends.deepspeed_backend import DeepSpeedBackend, uses_bf16_weights
    from vlrft.models.forward import policy_forward
    from vlrft.models.loader import enable_gradient_checkpointing
    from vlrft.models.packing import pack
    from vlrft.models.vision_calls import declare_modalities

    model = GPU_STEP["build_model"](shape, "sdpa", "bfloat16", "cpu", narrow=True)  # autocast, as on a GPU
    declare_modalities(model.model, modalities)
    if checkpointing:
        enable_gradient_checkpointing(model)
    backend = DeepSpeedBackend(model, lr=1e-6, weight_decay=0.0, grad_clip=1.0, zero_stage=zero,
                               bf16_weights=bf16_weights or uses_bf16_weights("bfloat16", zero))
    batch = pack(GPU_STEP["rollouts"](4))

    def loss():
        logp = policy_forward(backend.model, batch, 1.0).logp
        return -(logp * batch.response_mask).sum() / batch.response_mask.sum()

    backend.backward(loss(), boundary=True)  # a first step: DeepSpeed's buffers and hooks exist from here
    backend.step()
    with LaunchCount() as forward:
        value = loss()
    with LaunchCount() as backward:
        backend.backward(value, boundary=True)
    backend.step()
    return forward.total(), backward.total()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="1.5B", choices=[s for s in GPU_STEP["SHAPES"] if s != "tiny"])
    parser.add_argument("--zero", type=int, default=2, choices=[0, 1, 2, 3])
    parser.add_argument("--checkpointing", default="on", choices=["on", "off"])
    args = parser.parse_args()
    from vlrft.distributed import init_distributed

    init_distributed()  # a world of one: DeepSpeed needs a process group
    print(f"{args.shape} depths, ZeRO-{args.zero}, checkpointing {args.checkpointing}: kernel launches of one text micro-batch")
    counts = {}
    for label, modalities in (("images and videos", ("image", "video")), ("images", ("image",)), ("nothing", ())):
        forward, backward = counts[label] = launches(args.shape, args.zero, args.checkpointing == "on", modalities)
        print(f"  tower declared for {label:17s}  forward {forward:6d}  backward {backward:6d}  total {forward + backward:6d}")
    if args.zero == 2:  # (bf16 weights need ZeRO-2 or 3; ZeRO-3's rows above have them)
        forward, backward = launches(args.shape, args.zero, args.checkpointing == "on", (), bf16_weights=True)
        print(f"  {'... nothing, bf16 weights':36s}  forward {forward:6d}  backward {backward:6d}  total {forward + backward:6d}")
    both, none = sum(counts["images and videos"]), sum(counts["nothing"])
    print(f"  one vision-tower pass (forward and backward): {(both - none) // 2} launches; text data now launches "
          f"{both / none:.2f}x fewer than with both dummies")


if __name__ == "__main__":
    main()
