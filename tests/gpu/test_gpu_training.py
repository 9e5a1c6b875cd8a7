"""Training on a CUDA GPU: the colour demo under torchrun with NCCL (fp32 and bf16, ZeRO-2 and
ZeRO-3), and one update of a ~1.5B-shaped random Qwen2.5-VL with gradient checkpointing and
packing. Skip without a CUDA GPU, saying so. The full demo's accuracy (>= 0.95) is measured by
running it: `NPROC=1 bash examples/color_shapes/run.sh model.compute_dtype=bfloat16`.
"""

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU is visible")]

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("dtype, zero_stage", [("float32", 2), ("bfloat16", 2), ("bfloat16", 3)])
def test_colour_demo_trains_on_one_gpu_with_nccl(dtype, zero_stage, warm_vl, colour_data, tmp_path):
    """(The warmed model: an untrained one never writes an answer, so every reward is 0, every
    advantage 0 and every gradient 0, and the check below would say nothing.)"""
    from tests.integration.test_torchrun_training import free_port

    overrides = [
        f"model.path={warm_vl}", f"data.train_path={colour_data / 'train.jsonl'}",
        f"data.eval_path={colour_data / 'test.jsonl'}", f"model.compute_dtype={dtype}", f"train.zero_stage={zero_stage}",
        "model.gradient_checkpointing=true", "train.total_steps=4", "eval.every_steps=4", "checkpoint.save_steps=2",
        f"output.dir={tmp_path / 'run'}",
    ]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1", "--master_port", str(free_port()),
           "-m", "vlrft.cli", "train", str(REPO / "examples" / "color_shapes" / "config.yaml"), *overrides]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "held-out accuracy by step: 0:" in done.stdout
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in steps if "train/grad_norm" in r]
    assert len(train) == 4 and all(r["train/grad_norm"] > 0 and r["train/loss"] == r["train/loss"] for r in train)
    assert (tmp_path / "run" / "checkpoints" / "step_000004" / "trainer.pt").is_file()
    assert (tmp_path / "run" / "final" / "config.json").is_file()


def test_one_update_of_a_1_5b_shaped_vl_policy_with_checkpointing_and_packing(world_of_one):
    from vlrft.backends.deepspeed_backend import DeepSpeedBackend
    from vlrft.models.packing import pack, split_by_token_budget
    from vlrft.models.attention import resolve_attention
    from vlrft.models.forward import policy_forward
    from vlrft.models.loader import enable_gradient_checkpointing
    from vlrft.types import Prompt, Rollout

    # The benchmark's 1.5B shape: Qwen2.5-1.5B's decoder and Qwen2.5-VL's own vision tower.
    gpu_step = runpy.run_path(str(REPO / "bench" / "gpu_step.py"))
    model = gpu_step["build_model"]("1.5B", resolve_attention("auto", "bfloat16"), "bfloat16", "cuda")
    assert 2.1e9 < sum(p.numel() for p in model.parameters()) < 2.3e9
    assert enable_gradient_checkpointing(model) >= 28
    backend = DeepSpeedBackend(model, lr=1e-5, weight_decay=0.0, grad_clip=1.0, zero_stage=2)
    g = torch.Generator().manual_seed(0)
    rollouts = []
    for i in range(16):
        prompt = Prompt(str(i), "s", "", {}, "", torch.randint(10, 150000, (256,), generator=g).tolist(), index=i)
        rollouts.append(Rollout(prompt, i, torch.randint(10, 150000, (64 + 60 * i,), generator=g).tolist(), "", False))
    batches = [pack(group) for group in split_by_token_budget(rollouts, 8192)]
    assert len(batches) > 1 and any(len(b.samples) > 1 for b in batches)
    before = model.lm_head.weight.detach().float().clone()
    torch.cuda.reset_peak_memory_stats()
    for i, batch in enumerate(batches):
        logp = policy_forward(backend.model, batch, 1.0).logp
        loss = -logp.sum() / sum(len(r.response_ids) for r in rollouts)
        assert torch.isfinite(loss)
        backend.backward(loss, boundary=i == len(batches) - 1)
    assert backend.step() > 0
    assert not torch.equal(model.lm_head.weight.detach().float(), before)
    print(f"peak GPU memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB, attention {model.config._attn_implementation}")
