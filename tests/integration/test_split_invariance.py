"""Acceptance: one optimizer step's gradient does not depend on how its batch is split.

1 rank x 1 micro-batch, 1 rank x one micro-batch per sequence, 2 ranks (gloo) and 2 ranks whose
skewed shares were evened out by trainer/rank_balance agree within a relative difference of 1e-5
(fp32), in each of the four loss aggregation modes. Under DeepSpeed's bf16 mode the sums over
micro-batches and ranks are fp32 ones.
"""

import subprocess
from pathlib import Path

import pytest
import torch

from tests.process_env import rank_launch

pytestmark = pytest.mark.integration
WORKER = Path(__file__).with_name("grad_worker.py")


def gradients(model, data, micro_batch_tokens, ranks, out, share="strided", zero_stage=2, lora_rank=0, prompts="distinct",
              chunk_tokens=None, sequence_parallel=1):
    chunks = {"CHUNK_TOKENS": str(chunk_tokens)} if chunk_tokens else {}
    launcher, env = rank_launch(ranks, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
                                SEQUENCE_PARALLEL=str(sequence_parallel), PYTHONPATH=str(Path(__file__).parents[2]), **chunks)
    cmd = launcher + [str(WORKER), model, str(data / "train.jsonl"), str(micro_batch_tokens), str(out), share, str(zero_stage), str(lora_rank), prompts]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return torch.load(out)


@pytest.fixture(scope="session")
def one_rank(tiny_text, addition_data, tmp_path_factory):
    """prompts -> the reference: one rank, one micro-batch, full fine-tuning (computed once per
    test process, shared by the tests that compare against it)."""
    found = {}

    def reference(prompts: str = "distinct"):
        if prompts not in found:
            found[prompts] = gradients(tiny_text, addition_data, 100000, 1, tmp_path_factory.mktemp("whole") / "whole.pt",
                                       prompts=prompts)
        return found[prompts]

    return reference


def test_gradient_is_split_invariant_over_micro_batches_and_ranks(tiny_text, addition_data, tmp_path, one_rank):
    whole = one_rank()
    micro = gradients(tiny_text, addition_data, 40, 1, tmp_path / "micro.pt")
    ranks = gradients(tiny_text, addition_data, 40, 2, tmp_path / "ranks.pt")
    balanced = gradients(tiny_text, addition_data, 40, 2, tmp_path / "balanced.pt", share="balanced")
    assert sorted(whole) == ["seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm", "token-mean"]
    for mode, reference in whole.items():
        assert reference.norm() > 0, mode
        for name, other in (("micro-batches", micro[mode]), ("2 ranks", ranks[mode]), ("2 balanced ranks", balanced[mode])):
            rel = float((other - reference).norm() / reference.norm())
            assert rel <= 1e-5, f"{mode}, {name}: relative gradient difference {rel:.2e}"


def test_lora_gradient_is_the_same_under_zero3_micro_batches(tiny_text, addition_data, tmp_path):
    """LoRA freezes the LM head; the chunked head's recompute must still see its gathered
    ZeRO-3 weight (models/chunked.py): ZeRO-3 micro-batches over 2 ranks = ZeRO-2, 1 micro-batch."""
    whole = gradients(tiny_text, addition_data, 100000, 1, tmp_path / "whole.pt", lora_rank=4)
    split = gradients(tiny_text, addition_data, 40, 2, tmp_path / "split.pt", zero_stage=3, lora_rank=4)
    for mode, reference in whole.items():
        assert reference.numel() > 0 and reference.norm() > 0, mode
        rel = float((split[mode] - reference).norm() / reference.norm())
        assert rel <= 1e-5, f"{mode}, LoRA under ZeRO-3: relative gradient difference {rel:.2e}"


def test_zero3_ranks_with_more_lm_head_chunks_than_their_peers_agree(tiny_text, addition_data, tmp_path, one_rank):
    """ZeRO-3 gathers the LM head in every call: with 3-token chunks, rank 0's micro-batches (7 of
    the 8 responses before balancing) need more head calls than rank 1's; each rank still makes
    as many as the busiest (models/chunked.py), and the gradient is the single-rank one."""
    whole = one_rank()
    split = gradients(tiny_text, addition_data, 100000, 2, tmp_path / "split.pt", share="balanced", zero_stage=3,
                      chunk_tokens=3)
    mode = "token-mean"
    rel = float((split[mode] - whole[mode]).norm() / whole[mode].norm())
    assert rel <= 1e-5, f"ZeRO-3, unequal head calls: relative gradient difference {rel:.2e}"


@pytest.mark.parametrize("zero_stage", [2, 3])
def test_shared_prompt_gradient_equals_the_unshared_one_on_two_ranks(tiny_text, addition_data, tmp_path, zero_stage, one_rank):
    """Pairs of responses to one prompt: one unshared micro-batch on one rank = shared prompts
    split over micro-batches (the 23 + 7 + 12 token pair is cut in two at 40) and 2 balanced ranks."""
    whole = one_rank("shared-off")
    shared = gradients(tiny_text, addition_data, 40, 2, tmp_path / "shared.pt", share="balanced",
                       zero_stage=zero_stage, prompts="shared")
    for mode, reference in whole.items():
        rel = float((shared[mode] - reference).norm() / reference.norm())
        assert rel <= 1e-5, f"{mode}, ZeRO-{zero_stage} shared prompts: relative gradient difference {rel:.2e}"


def test_bf16_weights_sum_gradients_in_fp32_over_micro_batches_and_ranks(tiny_text, tmp_path):
    """DeepSpeed's bf16 mode (ZeRO-3's bf16 compute) backpropagates in bf16 but must add the
    micro-batches' and the ranks' gradients in fp32. Left to its defaults (bf16 sums), A's
    gradient added three times was 0.25% off 3 x A, and the ranks' mean 0.18% off the fp32 one;
    fp32 sums are exact to fp32 rounding. (3 x A also needs every micro-batch kept: ZeRO-3 counts
    micro-batches in the engine's forward, which vlrft's forwards bypass, so the backend advances
    the count itself; without it only the last micro-batch's gradient would remain.)"""
    worker = [str(Path(__file__).with_name("bf16_sum_worker.py")), tiny_text]
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    for ranks, out in ((1, one), (2, two)):
        launcher, env = rank_launch(ranks, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).parents[2]))
        proc = subprocess.run(launcher + worker + [str(out)], env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    one, two = torch.load(one), torch.load(two)

    def off(value, reference):  # the largest element's error, relative to the largest element
        return float((value - reference).abs().max() / reference.abs().max())

    assert one["a"].norm() > 0 and not torch.equal(one["a_then_b"], 2 * one["a"])
    assert off(one["a_thrice"], 3 * one["a"]) <= 1e-6  # micro-batches
    assert off(2 * two["mean_of_ranks"], one["a_then_b"]) <= 1e-6  # ranks (DeepSpeed divides by them)


@pytest.mark.parametrize("ranks, zero_stage, prompts", [(2, 2, "distinct"), (2, 3, "shared"), (4, 2, "distinct")])
def test_sequence_parallel_gradient_equals_the_single_rank_one(tiny_text, addition_data, tmp_path, ranks, zero_stage, prompts,
                                                              one_rank):
    """train.sequence_parallel 2: each micro-batch's tokens split over 2 ranks (with 4 ranks, 2
    groups of 2 data-parallel): the update's gradient is the one-rank one, in every loss
    aggregation (a sequence mean divides by the whole sequence's tokens, not a shard's)."""
    whole = one_rank("shared-off" if prompts == "shared" else prompts)
    split = gradients(tiny_text, addition_data, 40, ranks, tmp_path / "split.pt", zero_stage=zero_stage,
                      share="balanced" if prompts == "shared" else "strided", prompts=prompts, sequence_parallel=2)
    for mode, reference in whole.items():
        rel = float((split[mode] - reference).norm() / reference.norm())
        assert rel <= 1e-5, f"{mode}, sequence parallel over {ranks} ranks, ZeRO-{zero_stage}: relative gradient difference {rel:.2e}"
