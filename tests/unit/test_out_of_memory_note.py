"""A GPU out-of-memory error in `vlrft train` carries what to change, with the values now."""

import pytest
import torch

from vlrft.cli import out_of_memory_note, run_training
from vlrft.config import load_config


def config(tiny_text, addition_data, *overrides):
    return load_config(None, [f"model.path={tiny_text}", f"data.train_path={addition_data / 'train.jsonl'}", *overrides])


def test_an_out_of_memory_error_in_training_carries_the_levers_with_their_values(
        world_of_one, tiny_text, addition_data, monkeypatch):
    import vlrft.trainer.spmd_trainer as trainer_module

    class OutOfMemoryTrainer:  # the error as CUDA raises it, where building the trainer allocates
        def __init__(self, cfg):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(trainer_module, "SPMDTrainer", OutOfMemoryTrainer)
    cfg = config(tiny_text, addition_data, "train.micro_batch_tokens=8192")
    with pytest.raises(torch.OutOfMemoryError) as raised:
        run_training(cfg)
    assert raised.value.__notes__ == [
        "vlrft: this rank ran out of GPU memory (where: the traceback above). To fit, in this order: "
        "model.gradient_checkpointing=true; a smaller train.micro_batch_tokens (now 8192); "
        "train.zero_stage=3 (now 2); train.offload=optimizer. What fits which GPUs: docs/scaling.md, \"What fits\"."]


def test_the_levers_already_pulled_are_left_out_and_vllm_s_share_is_named(tiny_text, addition_data):
    cfg = config(tiny_text, addition_data, "model.gradient_checkpointing=true", "train.zero_stage=3",
                 "train.offload=optimizer", "rollout.engine=vllm", "rollout.vllm_memory_fraction=0.6")
    note = out_of_memory_note(cfg)
    assert "To fit, in this order: a smaller train.micro_batch_tokens (now 4096); a smaller " \
           "rollout.vllm_memory_fraction (now 0.6)." in note
    assert "gradient_checkpointing" not in note and "zero_stage" not in note and "offload" not in note


def test_a_teacher_is_named_among_the_levers(tiny_text, addition_data):
    fp32 = out_of_memory_note(config(tiny_text, addition_data, f"teacher.path={tiny_text}"))
    assert "; teacher.compute_dtype=bfloat16 (the teacher is held whole on every rank that trains)." in fp32
    bf16 = out_of_memory_note(config(tiny_text, addition_data, f"teacher.path={tiny_text}", "teacher.compute_dtype=bfloat16"))
    assert "; a smaller teacher.path (the teacher is held whole, in bf16, on every rank that trains)." in bf16


def test_other_errors_carry_no_note(world_of_one, tiny_text, addition_data, monkeypatch):
    import vlrft.trainer.spmd_trainer as trainer_module

    class FailingTrainer:
        def __init__(self, cfg):
            raise RuntimeError("something else")

    monkeypatch.setattr(trainer_module, "SPMDTrainer", FailingTrainer)
    with pytest.raises(RuntimeError) as raised:
        run_training(config(tiny_text, addition_data))
    assert not hasattr(raised.value, "__notes__")
