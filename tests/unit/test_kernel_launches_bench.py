"""bench/kernel_launches.py counts the ops that launch a kernel on a GPU: views and shapes are
left out, each computing op is counted once per call."""

import runpy
from pathlib import Path

import torch

KERNEL_LAUNCHES = runpy.run_path(str(Path(__file__).resolve().parents[2] / "bench" / "kernel_launches.py"))


def test_views_launch_nothing_and_each_computing_op_counts_once():
    x = torch.randn(4, 6)
    with KERNEL_LAUNCHES["LaunchCount"]() as counted:
        y = x.view(6, 4).t().unsqueeze(0)[0]  # views only
        z = (y * 2 + 1).sum()  # three kernels
        z.detach()
    assert dict(counted.counts) == {"mul": 1, "add": 1, "sum": 1} and counted.total() == 3
