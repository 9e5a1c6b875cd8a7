"""Sequence parallelism (models/sequence_parallel.py) on CPU ranks (gloo): a packed micro-batch
with its tokens split over 2 ranks gives the per-token logprobs, entropies and values, and the
parameter gradients, of the micro-batch run whole, to 1e-5 in fp32."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_torchrun_training import free_port
from tests.process_env import fresh_process_env

pytestmark = pytest.mark.integration
WORKER = Path(__file__).with_name("sequence_parallel_worker.py")


def sharded_against_whole(case: str, model: str, data, out: Path, ranks: int = 2) -> dict:
    env = fresh_process_env(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(Path(__file__).parents[2]))
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_port", str(free_port())]
    proc = subprocess.run(launcher + [str(WORKER), case, model, str(data), str(out)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_two_ranks_sharing_a_vision_language_micro_batch_equal_it_whole(tiny_vl, colour_data, tmp_path):
    """Text with one and two images, shared prompts, video with an image, and gradient
    checkpointing with a frozen vision tower (one launch, a case after the other)."""
    cases = ["vl", "vl-shared", "video", "vl-checkpointed-frozen"]
    results = sharded_against_whole(",".join(cases), tiny_vl, colour_data, tmp_path / "out.json")
    assert sorted(results) == sorted(cases)
    for case, result in results.items():
        assert 0 < result["scored_here"] < result["scored"], case  # rank 0 scored its shard's tokens only
        assert max(result["outputs"]) <= 1e-5 and max(result["teacher"]) <= 1e-5, (case, result)
        assert result["gradient"] <= 1e-5, (case, result)


def test_two_ranks_sharing_a_qwen3_vl_micro_batch_equal_it_whole(vl_models, colour_data, tmp_path):
    """Qwen3-VL adds deepstack features to its visual tokens' hidden states in early layers:
    each rank adds those of its shard's visual tokens."""
    result = sharded_against_whole("qwen3-vl", vl_models("qwen3-vl"), colour_data, tmp_path / "out.json")["qwen3-vl"]
    assert 0 < result["scored_here"] < result["scored"]
    assert max(result["outputs"]) <= 1e-5 and max(result["teacher"]) <= 1e-5, result
    assert result["gradient"] <= 1e-5, result


def test_two_ranks_sharing_a_text_micro_batch_equal_it_whole(tiny_text, addition_data, tmp_path):
    result = sharded_against_whole("text", tiny_text, addition_data, tmp_path / "out.json")["text"]
    assert 0 < result["scored_here"] < result["scored"]
    assert max(result["outputs"]) <= 1e-5 and max(result["teacher"]) <= 1e-5, result
    assert result["gradient"] <= 1e-5, result


def test_four_ranks_sharing_a_text_micro_batch_equal_it_whole(tiny_text, addition_data, tmp_path):
    """N = 4 needs 4 key/value heads: the tiny text model with its 2 repeated (the same function)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_text)
    attention = model.config.num_attention_heads // model.config.num_key_value_heads
    for layer in model.model.layers:  # each key/value head's rows twice: heads 0, 0, 1, 1
        for projection in (layer.self_attn.k_proj, layer.self_attn.v_proj):
            head = projection.out_features // model.config.num_key_value_heads
            for name in ("weight", "bias"):
                rows = getattr(projection, name).data.view(model.config.num_key_value_heads, head, -1)
                setattr(projection, name, torch.nn.Parameter(rows.repeat_interleave(2, dim=0).reshape(-1, *rows.shape[2:]).squeeze(-1)))
    model.config.num_key_value_heads *= 2
    assert model.config.num_attention_heads // model.config.num_key_value_heads == attention // 2
    wide = tmp_path / "kv4"
    model.save_pretrained(wide)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(tiny_text) / name, wide / name)
    result = sharded_against_whole("text", str(wide), addition_data, tmp_path / "out.json", ranks=4)["text"]
    assert 0 < result["scored_here"] < result["scored"]
    assert max(result["outputs"]) <= 1e-5 and max(result["teacher"]) <= 1e-5, result
    assert result["gradient"] <= 1e-5, result
