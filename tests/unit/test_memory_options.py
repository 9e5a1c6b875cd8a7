"""Memory options for real model sizes: gradient checkpointing, CPU offload, bf16 under ZeRO-3,
a bf16 reference. Each changes where memory goes, and a test shows it acts; the update stays
what the fp32 baseline computes (exactly, or within the named rounding)."""

from __future__ import annotations

import queue
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from tests.process_env import fresh_process_env
from tests.unit.test_config_wiring import RECIPE
from vlrft.backends.deepspeed_backend import deepspeed_config, extension_build_lock
from vlrft.config import ConfigError, load_config
from vlrft.models.packing import pack
from vlrft.models.forward import policy_forward
from vlrft.models.loader import enable_gradient_checkpointing, load_model
from vlrft.trainer.build import load_reference
from vlrft.trainer.spmd_trainer import SPMDTrainer


@pytest.fixture(scope="module")
def base(tmp_path_factory, tiny_text, addition_data, world_of_one):
    root = tmp_path_factory.mktemp("memory")
    (root / "recipe.py").write_text(RECIPE)
    return [
        f"model.path={tiny_text}",
        f"data.train_path={addition_data / 'train.jsonl'}",
        "rollout.rollout_prompts=2",
        "rollout.n_samples_per_prompt=4",
        "rollout.max_new_tokens=6",
        "train.lr=0.001",
        "train.total_steps=2",
        "algo.kl.coef=0.1",
        "eval.every_steps=0",
        f"reward.default=[{{recipe: '{root / 'recipe.py'}:distinct_chars'}}]",  # rewards that differ within groups
        f"output.dir={root / 'run'}",
    ]


def policy_vector(trainer) -> torch.Tensor:
    """The policy's full (unsharded, under ZeRO-3 gathered) parameters as one fp32 vector."""
    return torch.cat([t.detach().flatten().float() for _, t in trainer.backend.named_full_parameters()])


def one_step(overrides) -> tuple[SPMDTrainer, torch.Tensor]:
    torch.manual_seed(0)
    trainer = SPMDTrainer(load_config(None, overrides))
    before = policy_vector(trainer)
    trainer.train_step()
    return trainer, policy_vector(trainer) - before


@pytest.fixture(scope="module")
def baseline(base):
    update = one_step(base)[1]
    assert update.abs().max() > 1e-4  # a real update to compare against
    return update


def count_calls(module: torch.nn.Module) -> list:
    """Calls of `module`, counted as they start (checkpointing's recomputation stops as soon as
    the saved tensors are back, so a hook at a module's end may never see it)."""
    calls = []
    module.register_forward_pre_hook(lambda *_: calls.append(1))
    return calls


def test_gradient_checkpointing_recomputes_layers_and_keeps_gradients(tiny_vl, mixed_rollouts):
    plain, checkpointed = load_model(tiny_vl), load_model(tiny_vl)
    layers = enable_gradient_checkpointing(checkpointed)
    text_layers = checkpointed.config.get_text_config().num_hidden_layers
    assert layers >= text_layers  # decoder layers (and the vision blocks of a VL model)
    assert not any(m.training for m in checkpointed.modules() if isinstance(m, torch.nn.Dropout))  # dropout stays off
    plain_calls = count_calls(plain.model.language_model.layers[0].input_layernorm)
    checkpointed_calls = count_calls(checkpointed.model.language_model.layers[0].input_layernorm)
    batch = pack(mixed_rollouts)
    for model in (plain, checkpointed):
        out = policy_forward(model, batch, 1.0)
        (out.logp.sum() + 0.1 * out.entropy.sum()).backward()
    assert (len(plain_calls), len(checkpointed_calls)) == (1, 2)  # recomputed in backward
    for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(q.grad, p.grad, rtol=0, atol=1e-6, msg=name)


def test_gradient_checkpointing_in_training_gives_the_same_update(base, baseline):
    trainer, update = one_step(base + ["model.gradient_checkpointing=true"])
    assert trainer.backend.module.model.layers[0].gradient_checkpointing
    torch.testing.assert_close(update, baseline, rtol=0, atol=1e-6)


def test_optimizer_offload_steps_on_the_cpu_with_the_same_update(base, baseline):
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    trainer, update = one_step(base + ["train.offload=optimizer"])
    assert isinstance(trainer.backend.engine.optimizer.optimizer, DeepSpeedCPUAdam)
    # DeepSpeed's CPU AdamW and torch's AdamW differ in rounding only; Adam normalises each
    # step, so a parameter whose gradient is ~0 can flip: compare all but a few.
    close = torch.isclose(update, baseline, rtol=1e-3, atol=1e-6)
    assert close.float().mean() > 0.999 and update.abs().max() > 1e-4


def test_bf16_under_zero3_uses_deepspeed_bf16_mode(base, baseline):
    trainer, update = one_step(base + ["train.zero_stage=3", "model.compute_dtype=bfloat16"])
    params = list(trainer.backend.module.parameters())
    assert {p.dtype for p in params} == {torch.bfloat16}  # bf16 weights, sharded
    masters = trainer.backend.engine.optimizer.fp32_partitioned_groups_flat
    assert masters and {m.dtype for m in masters} == {torch.float32}  # fp32 master weights
    assert {t.dtype for _, t in trainer.backend.named_full_parameters()} == {torch.bfloat16}
    assert next(trainer.reference.parameters()).dtype == torch.bfloat16
    # The same step in bf16: a real update in the fp32 baseline's direction.
    cosine = torch.nn.functional.cosine_similarity(update, baseline, dim=0)
    assert torch.isfinite(update).all() and update.abs().max() > 1e-4 and cosine > 0.5


def test_reference_is_bf16_only_when_frozen_under_bf16_compute(base):
    precision = ("sdpa", "bfloat16")
    frozen = load_reference(load_config(None, base + ["model.compute_dtype=bfloat16"]), precision)
    assert {p.dtype for p in frozen.parameters()} == {torch.bfloat16} and not frozen.training
    moving = load_reference(load_config(None, base + ["model.compute_dtype=bfloat16", "algo.kl.ref_ema_eta=0.1"]), precision)
    assert {p.dtype for p in moving.parameters()} == {torch.float32}  # small EMA steps would round away in bf16
    fp32 = load_reference(load_config(None, base), ("sdpa", "float32"))
    assert {p.dtype for p in fp32.parameters()} == {torch.float32}


@pytest.mark.parametrize("stage, offload, bf16, expected", [
    (2, "none", False, {"stage": 2}),
    (2, "optimizer", False, {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": torch.cuda.is_available()}}),
    (3, "all", True, {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": torch.cuda.is_available()},
                      "offload_param": {"device": "cpu", "pin_memory": torch.cuda.is_available()},
                      "reduce_bucket_size": 250_000_000}),  # (fp32 gradient sums: DeepSpeed's bucket bytes)
])
def test_deepspeed_config_follows_the_keys(stage, offload, bf16, expected):
    config = deepspeed_config(stage, 1.0, offload, bf16)
    assert config["zero_optimization"] == expected
    assert ("bf16" in config) == bf16 and config["gradient_clipping"] == 1.0
    assert ("data_types" in config) == ("communication_data_type" in config) == bf16


def test_bf16_weights_without_zero_2_or_3_are_refused():
    with pytest.raises(ValueError, match="bf16 weights need ZeRO stage 2 or 3, not 1"):
        deepspeed_config(1, 1.0, "none", True)


@pytest.mark.parametrize("overrides, message", [
    (["train.offload=cpu"], "config key 'train.offload' is 'cpu'; valid: none, optimizer, all"),
    (["train.offload=optimizer", "train.zero_stage=0"], "'train.offload' optimizer needs train.zero_stage 1, 2 or 3"),
    (["train.offload=all", "train.zero_stage=2"], "'train.offload' all (parameters too) needs train.zero_stage 3"),
])
def test_offload_config_errors_name_the_key(overrides, message, tmp_path):
    (tmp_path / "cfg.yaml").write_text("model: {path: m}\ndata: {train_path: d.jsonl}\n")
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "cfg.yaml", overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_cpu_adam_build_lock_left_behind_is_named_while_the_run_waits(tmp_path):
    # A build of DeepSpeed's CPU Adam killed midway leaves torch's lock file; a later run waits
    # on it forever. It must say so rather than hang in silence.
    lock = tmp_path / "cpu_adam" / "lock"
    lock.parent.mkdir()
    lock.touch()
    probe = (
        "import torch\n"
        "from vlrft.distributed import init_distributed\n"
        "from vlrft.backends.deepspeed_backend import DeepSpeedBackend\n"
        "init_distributed()\n"
        "DeepSpeedBackend(torch.nn.Linear(4, 4), lr=0.1, weight_decay=0.0, grad_clip=1.0, zero_stage=2, offload='optimizer')\n"
    )
    env = fresh_process_env(TORCH_EXTENSIONS_DIR=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", probe], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    lines = queue.Queue()  # read aside: without the message the probe waits on the lock for ever
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    try:
        line = ""
        while not line.startswith("vlrft:"):
            line = lines.get(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    assert line.strip() == (f"vlrft: DeepSpeed's CPU Adam (train.offload) waits for {lock} to go: another process is "
                            "building it, or a build was interrupted (then delete the file)")


def test_the_build_lock_is_where_torch_builds_for_this_python_and_accelerator(tmp_path, monkeypatch):
    import torch.utils.cpp_extension

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setattr(torch.utils.cpp_extension, "get_default_build_root", lambda: str(tmp_path))
    torch_s_own = torch.utils.cpp_extension._get_build_directory("cpu_adam", verbose=False)  # (private: a cross-check)
    assert extension_build_lock("cpu_adam") == Path(torch_s_own) / "lock"
    assert extension_build_lock("cpu_adam").parent.parent.parent == tmp_path  # one folder per Python and accelerator
