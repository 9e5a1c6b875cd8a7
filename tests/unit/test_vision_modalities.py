"""The vision tower runs only for the modalities the run's data holds (models/vision_calls.py):
which those are, that the trainer declares them on every model, and that DeepSpeed's update is
the same to the bit whether the tower runs on dummies or not at all."""

import json
import subprocess
import sys

import torch

from tests.process_env import fresh_process_env
from vlrft.data.dataset import modalities_of
from vlrft.trainer.vision_modalities import data_modalities


def row(*kinds):
    parts = [{"type": "image", "image": "a.png"} if k == "image" else {"type": "video", "video": "v.mp4"} for k in kinds]
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "?"}]}, {"role": "assistant", "content": "x"}]}


def test_the_modalities_are_those_of_any_row_and_of_environments():
    text = {"messages": [{"role": "user", "content": "2 + 2?"}]}
    assert modalities_of([text, row()]) == set()
    assert modalities_of([text, row("image"), row()]) == {"image"}
    assert modalities_of([row("video"), row("image", "video")]) == {"image", "video"}
    assert data_modalities([text], set(), False) == set()
    assert data_modalities([text], {"video"}, False) == {"video"}  # PTX rows'
    assert data_modalities([row("video")], set(), True) == {"image", "video"}  # an observation may show images


def test_an_environment_may_say_its_observations_are_text_only(tmp_path):
    from types import SimpleNamespace

    import pytest

    from vlrft.multiturn.environment import EnvironmentFailure, shows_images
    from vlrft.multiturn.rollout import observation_images

    (tmp_path / "envs.py").write_text("class Game:\n    pass\n\nclass Words:\n    shows_images = False\n")
    assert shows_images(f"{tmp_path / 'envs.py'}:Game")  # unless it says otherwise
    assert not shows_images(f"{tmp_path / 'envs.py'}:Words")
    assert not shows_images("tools") and not shows_images("")  # the built-in tool environment: text results
    # One that said so and shows an image anyway fails that turn (its tower was never declared).
    text_only = SimpleNamespace(shows_images=False)
    assert observation_images([], text_only, "r1") == ("", {}, [])
    with pytest.raises(EnvironmentFailure, match="showed 1 image.s. on row 'r1', but its class says shows_images = False"):
        observation_images(["a.png"], text_only, "r1")


def test_the_trainer_declares_the_data_modalities_on_its_models(tiny_vl, colour_data, tmp_path, world_of_one):
    from vlrft.config import load_config
    from vlrft.trainer.spmd_trainer import SPMDTrainer

    text_rows = tmp_path / "text.jsonl"
    text_rows.write_text("".join(json.dumps({"id": str(i), "data_source": "t", "answer": "4", "messages": [
        {"role": "user", "content": f"What is {i} + 2?"}]}) + "\n" for i in range(4)))
    base = ["rollout.rollout_prompts=2", "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=4", "algo.kl.coef=0.1",
            "algo.advantage=gae", "critic.enabled=true", f"model.path={tiny_vl}", f"output.dir={tmp_path / 'run'}",
            "data.allow_external_media=true"]  # (the step API's image row names its file by absolute path)
    for data, expected in ((colour_data / "train.jsonl", ("image",)), (text_rows, ())):
        trainer = SPMDTrainer(load_config(None, base + [f"data.train_path={data}"]))
        backbones = (trainer.backend.module.model, trainer.critic.module.backbone, trainer.reference.model)
        assert [b.vision_modalities for b in backbones] == [expected] * 3
        calls = []
        trainer.backend.module.model.visual.register_forward_pre_hook(lambda module, args: calls.append(1))
        trainer.train_step()
        assert bool(calls) == bool(expected)
    # The step API's rows may hold what the data file does not: the set grows before they train.
    image_row = json.loads((colour_data / "train.jsonl").read_text().splitlines()[0])
    for part in image_row["messages"][0]["content"]:
        if part["type"] == "image":
            part["image"] = str(colour_data / part["image"])
    logprobs = trainer.response_logprobs([image_row], [["<answer>red</answer>"]])
    assert [b.vision_modalities for b in backbones] == [("image",)] * 3 and calls
    trainer.step([image_row], [["<answer>red</answer>", "<answer>blue</answer>"]], [[1.0, 0.0]])
    assert trainer.global_step == 2 and logprobs[0][0] < 0


UPDATE = """
import json, sys, torch
from vlrft.distributed import init_distributed
init_distributed()
from vlrft.backends.deepspeed_backend import DeepSpeedBackend
from vlrft.models.forward import policy_forward
from vlrft.models.loader import load_model
from vlrft.models.packing import pack
from vlrft.models.vision_calls import declare_modalities
from vlrft.types import Prompt, Rollout

def weights_after_two_steps(path, zero, modalities):
    model = load_model(path)
    declare_modalities(model.model, modalities)
    backend = DeepSpeedBackend(model, lr=1e-2, weight_decay=0.1, grad_clip=1.0, zero_stage=zero)
    g = torch.Generator().manual_seed(0)
    rollouts = [Rollout(Prompt(id=str(i), data_source="t", answer="", meta={}, prompt_text="",
                               prompt_ids=torch.randint(10, 100, (12,), generator=g).tolist(), index=i),
                        i, torch.randint(10, 100, (6,), generator=g).tolist(), "", False) for i in range(3)]
    for step in range(2):
        for i, batch in enumerate([pack(rollouts[:2]), pack(rollouts[2:])]):
            logp = policy_forward(backend.model, batch, 1.0).logp
            backend.backward(-(logp * batch.response_mask).sum() / 10, boundary=i == 1)
        backend.step()
    return {n: t.detach().float().clone() for n, t in backend.full_state_dict().items()}

start = {n: t.float() for n, t in load_model(sys.argv[1]).state_dict().items()}
out = {}
for zero in (2, 3):  # (ZeRO-3 last: DeepSpeed keeps its engines' parameters referenced)
    dummies = weights_after_two_steps(sys.argv[1], zero, ("image", "video"))
    never = weights_after_two_steps(sys.argv[1], zero, ())
    tower = [n for n in start if ".visual." in n]
    out[zero] = {"same": all(torch.equal(dummies[n], never[n]) for n in dummies),
                 "tower_moved": max((never[n] - start[n]).abs().max().item() for n in tower)}
print(json.dumps(out))
"""


def test_an_update_without_tower_calls_equals_one_with_dummies_under_zero_2_and_3(tiny_vl):
    # Text micro-batches: with dummies the tower gets exact zero gradients; without, none.
    # DeepSpeed steps both the same (weight decay included), so skipping the dummy is exact.
    done = subprocess.run([sys.executable, "-c", UPDATE, tiny_vl], capture_output=True, text=True, timeout=600,
                          env=fresh_process_env())
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    for zero in ("2", "3"):
        assert result[zero]["same"], zero
        assert result[zero]["tower_moved"] > 0  # the decay moved it: the comparison covers the tower's step
