"""The model-FLOP count behind `perf/mfu` (hand-computed) and bench/gpu_step.py's use of it, the
MFU metric's arithmetic, and the recompile watch."""

import runpy
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vlrft.metrics.flops import FlopCount, peak_tflops, throughput_metrics
from vlrft.models.packing import pack
from vlrft.trainer.watches import CompileWatch
from vlrft.types import Prompt, Rollout


def tiny_config(**extra):
    text = SimpleNamespace(hidden_size=4, num_attention_heads=2, num_key_value_heads=1, intermediate_size=8,
                           num_hidden_layers=2, vocab_size=10, **extra)
    return SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: text))


def test_flops_by_hand():
    count = FlopCount.of(tiny_config())
    # q and o: 4 x 4 each; k and v: 4 x (1 head x 2) each; MLP: 3 x 4 x 8
    assert count.layer_matmul_params == 16 + 16 + 8 + 8 + 96
    # two sequences of 3 and 2 tokens, 2 scored: decoder 144 x 2 layers x 5 tokens = 1440;
    # attention 2 x 2 layers x 4 wide x (9/2 + 4/2 pairs) = 104; head 4 x 10 x 2 = 80
    assert count.flops([3, 2], None, 2) == 6 * (1440 + 104 + 80)
    assert count.flops([3, 2], None, 2, attention=False) == 6 * (1440 + 80)
    # the 2-token segment continues the 3-token prompt: 2 x 3 more pairs
    assert count.flops([3, 2], [-1, 0], 2) == 6 * (1440 + 2 * 2 * 4 * (6.5 + 6) + 80)


def test_mixture_of_experts_counts_the_active_experts():
    moe = FlopCount.of(tiny_config(moe_intermediate_size=2, num_experts_per_tok=3))
    assert moe.layer_matmul_params == 48 + 3 * 4 * 2 * 3


def test_micro_batch_count_follows_the_packed_layout():
    def rollout(prompt_ids, response):
        prompt = Prompt(id="p", data_source="t", answer="", meta={}, prompt_text="", prompt_ids=prompt_ids, index=0)
        return Rollout(prompt, 0, response, "", False)

    count = FlopCount.of(tiny_config())
    shared = pack([rollout([1, 2, 3], [4, 5]), rollout([1, 2, 3], [6])], share=True)  # prompt once, then 2 and 1
    assert shared.seq_lengths == [3, 2, 1]
    assert count.micro_batch(shared) == count.flops([3, 2, 1], [-1, 0, 0], 3)


def test_bench_counts_as_the_trainer_does():
    bench = runpy.run_path(str(Path(__file__).resolve().parents[2] / "bench" / "gpu_step.py"))
    hidden, layers, heads, kv_heads, mlp = bench["SHAPES"]["1.5B"]
    text = SimpleNamespace(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv_heads,
                           intermediate_size=mlp, num_hidden_layers=layers, vocab_size=bench["VOCAB"])
    model = SimpleNamespace(config=SimpleNamespace(get_text_config=lambda: text))
    samples = bench["rollouts"](4)
    tokens = sum(len(r.prompt.prompt_ids) + len(r.response_ids) for r in samples)
    # The formula the bench's docstring and docs/scaling.md state, written out once more.
    layer = 2 * hidden * hidden + 2 * hidden * (hidden // heads * kv_heads) + 3 * hidden * mlp
    attention = sum(2 * layers * hidden * (len(r.prompt.prompt_ids) + len(r.response_ids)) ** 2 / 2 for r in samples)
    head = hidden * bench["VOCAB"] * sum(len(r.response_ids) for r in samples)
    assert bench["model_flops"](model, samples) == pytest.approx(6 * (layers * layer * tokens + attention + head), rel=1e-12)


def test_mfu_metric():
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0 and peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA H200") == 989.0 and peak_tflops("Tesla T4") is None
    # 2 GPUs did 989e12 x 0.5 FLOPs together in 0.5 s: each 494.5 TFLOP/s, 50% of an H100 SXM
    metrics = throughput_metrics(989e12 * 0.5, 1000.0, 0.5, 2, "NVIDIA H100 80GB HBM3")
    assert metrics == pytest.approx({"perf/tokens_per_second_per_gpu": 1000.0, "perf/mfu": 50.0})
    assert throughput_metrics(1e12, 10.0, 1.0, 1, "Tesla T4") == {"perf/tokens_per_second_per_gpu": 10.0}
    assert throughput_metrics(1e12, 10.0, 1.0, 1, None) == {}


def test_compile_watch_warns_once_per_streak_of_compiling_steps():
    watch = CompileWatch(frames=10, patience=3)
    seen = [watch.update(frames) for frames in (14, 15, 15, 16, 17, 18, 19, 19)]
    assert seen == [(4, False), (1, False), (0, False), (1, False), (1, False), (1, True), (1, False), (0, False)]


def test_update_reports_throughput_on_cuda_only():
    from vlrft.trainer.update import update_throughput

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the GPU tests cover the metric there")
    assert update_throughput(1e12, 100.0, 0.0) == {}
