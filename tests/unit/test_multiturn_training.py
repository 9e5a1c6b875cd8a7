"""Multi-turn trajectories through the experience maker and the updates: the maker's logprobs
equal the trainer's forward, and observation tokens weigh nothing in any loss or advantage."""

import copy

import pytest
import torch
from deepspeed.utils import safe_get_full_grad

from tests.unit.test_logprob_consistency import SEVERAL_STEPS, build_trainer
from vlrft.algo.advantages import discounted_returns, gae_advantages, token_rewards
from vlrft.models.collate import gather_responses
from vlrft.models.forward import token_logprobs
from vlrft.multiturn.environment import resolve_environment
from vlrft.trainer.critic_update import critic_update
from vlrft.trainer.build import update_settings
from vlrft.trainer.update import policy_update

NUDGE = '''
import time

from PIL import Image

from vlrft.multiturn.environment import Step


class Nudge:
    """Answers every turn with the same reply (after an image of `image` pixels whose colour
    depends on the turn, when given); the trajectory ends after `turns` steps."""

    observation_role = "user"

    def __init__(self, reply, turns, delay=0.0, image=None):
        self.reply, self.turns, self.delay, self.image = reply, turns, delay, image

    def reset(self, sample):
        self.steps = 0

    def step(self, action):
        time.sleep(self.delay if self.steps == 0 else 0.0)
        self.steps += 1
        images = [Image.new("RGB", tuple(self.image), (60 * self.steps, 200, 40))] if self.image else []
        return Step(self.reply, 0.5 if "1" in action else 0.0, self.steps >= self.turns, images)
'''


def build(model, data, tmp_path, extra=()):
    (tmp_path / "nudge.py").write_text(NUDGE)
    return build_trainer(model, data, tmp_path, [
        SEVERAL_STEPS, f"rollout.environment={tmp_path / 'nudge.py'}:Nudge",
        "rollout.environment_args={reply: 'Check it again.', turns: 3}", "rollout.max_turns=3",
        "rollout.max_new_tokens=12", "rollout.max_trajectory_tokens=80", "algo.advantage=gae", "critic.enabled=true", "algo.entropy_coef=0.01", *extra,
    ])


@pytest.fixture(scope="module", params=["text", "image"])
def made(request, warm_text, warm_vl, addition_data, colour_data, tmp_path_factory, world_of_one):
    """A multi-turn batch: text prompts, or image prompts whose observations show an image too
    (the HF engine continues them with every image's pixels and M-RoPE positions)."""
    model, data = (warm_text, addition_data) if request.param == "text" else (warm_vl, colour_data)
    image = [] if request.param == "text" else ["rollout.environment_args={reply: 'Check it again.', turns: 3, image: [56, 84]}"]
    trainer = build(model, data, tmp_path_factory.mktemp("multiturn"), image)
    torch.manual_seed(0)
    prompts = [trainer.encoder.encode(trainer.train_rows[row], pos) for pos, row in trainer.sampler.next_indices()]
    experiences, metrics = trainer.maker.make(prompts)
    return trainer, experiences, metrics


def test_multi_turn_experiences(made):
    trainer, experiences, _ = made
    assert len(experiences) == 12
    observed = [e for e in experiences if 0 in e.rollout.trained]
    assert observed, "some trajectory got an observation"
    reply = trainer.encoder.tokenizer.encode("Check it again.", add_special_tokens=False)
    for e in observed:
        ids, trained = e.rollout.response_ids, e.rollout.trained
        observation = [t for t, k in zip(ids, trained) if not k]
        assert all(observation[i : i + len(reply)] == reply for i in [observation.index(reply[0])])
        assert len(ids) <= 80 and 2 <= len(e.rollout.turns) <= 3
        out = torch.tensor(trained) == 0
        assert (e.advantages[out] == 0).all() and (e.returns[out] == 0).all()
        assert e.reward_components is not None


def test_observation_images_enter_the_sequence_with_their_pixels(made):
    """Each image an observation showed is in the response as one image pad per merged patch
    (inside the template's image part), with its pixel inputs and modality ids."""
    trainer, experiences, _ = made
    if trainer.encoder.image_processor is None:
        assert not any(e.rollout.observation_images for e in experiences)
        return
    tokenizer = trainer.encoder.tokenizer
    pad, start = tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<|vision_start|>"])
    shown = [e for e in experiences if e.rollout.observation_images]
    assert shown
    for e in shown:
        r = e.rollout
        images = sum(turn.get("images", 0) for turn in r.turns)
        assert len(r.observation_images) == images == r.response_ids.count(start) == len(r.observation_mm_inputs["image_grid_thw"])
        assert r.observation_mm_inputs["image_grid_thw"].tolist() == [[1, 6, 4]] * images  # 84 high x 56 wide, 14-pixel patches
        assert r.response_ids.count(pad) == 6 * images  # 6 x 4 patches, 2 x 2 merged per token
        assert r.response_mm_token_types == [1 if t == pad else 0 for t in r.response_ids]
        assert all(k == 0 for k, t in zip(r.trained, r.response_ids) if t in (pad, start))
        assert r.mm_inputs()["pixel_values"].shape[0] == r.prompt.mm_inputs["pixel_values"].shape[0] + 24 * images
    assert trainer.maker.settings.image_check.first_problem(experiences) is None


def test_packed_forward_positions_equal_the_models_own(made):
    """The trainer's packed positions (M-RoPE over the whole sequence when observations hold
    images) equal what the model numbers itself from a padded batch's modality ids."""
    from vlrft.models.collate import collate

    trainer, experiences, _ = made
    with torch.no_grad():
        for e in experiences[:4]:
            batch = collate([e], trainer.encoder.tokenizer.pad_token_id)
            logp = token_logprobs(trainer.backend.model, batch, trainer.cfg.rollout.temperature)
            torch.testing.assert_close(gather_responses(batch, logp)[0], e.old_logprobs, rtol=0, atol=1e-5)


def test_maker_logprobs_equal_the_engine_and_the_trainer_forward(made):
    """The engine sampled each turn from the ids it was given: on every generated token the
    experience pass agrees with the engine (as closely as in single-turn runs: KV-cache decoding
    vs one forward, ~1e-4 here) and the trainer's packed forward with the experience pass (1e-5)."""
    trainer, experiences, metrics = made
    worst_engine = 0.0
    for e in experiences:
        trained = torch.tensor(e.rollout.trained, dtype=torch.bool)
        engine = torch.tensor(e.rollout.logprobs)
        worst_engine = max([worst_engine, *(engine - e.old_logprobs)[trained].abs().tolist()])
    assert worst_engine <= 3e-4, worst_engine
    trainer.buffer.clear()
    trainer.buffer.add(experiences)
    checked = 0
    with torch.no_grad():
        for batch in trainer.buffer.micro_batches(shuffle=True):
            logp = token_logprobs(trainer.backend.model, batch, trainer.cfg.rollout.temperature)
            for e, row in zip(batch.samples, gather_responses(batch, logp)):
                torch.testing.assert_close(row, e.old_logprobs, rtol=0, atol=1e-5)
                checked += 1
    assert checked == 12
    assert metrics["rollout/engine_logprob_diff_max"] == pytest.approx(worst_engine)


def record_gradients(backend, run) -> torch.Tensor:
    """The gradient `run` accumulates before its optimizer step; the step is skipped (weights stay)."""
    grads = []

    def record():
        grads.append(torch.cat([safe_get_full_grad(p).flatten().clone() for p in backend.module.parameters() if p.requires_grad]))
        backend.skip_step()
        return 0.0

    backend.step, real = record, backend.step
    try:
        run()
    finally:
        backend.step = real
    return grads[0]


def gradients(trainer, experiences):
    trainer.buffer.clear()
    trainer.buffer.add(experiences)
    cfg = trainer.cfg
    policy = record_gradients(trainer.backend, lambda: policy_update(trainer.backend, trainer.buffer, update_settings(cfg), 0.1, trainer.reference))
    critic = record_gradients(trainer.critic, lambda: critic_update(trainer.critic, trainer.buffer, update_settings(cfg)))
    return policy, critic


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_observation_tokens_weigh_nothing_in_any_loss(made):
    """Garbage in every per-token field of the observation tokens changes no gradient (policy:
    clipped ratio, KL, entropy; critic: value loss); the same change on one generated token does."""
    trainer, experiences, _ = made
    g = torch.Generator().manual_seed(1)
    garbage = copy.deepcopy(experiences)
    for e in garbage:
        out = torch.tensor(e.rollout.trained) == 0
        for name in ("old_logprobs", "ref_logprobs", "advantages", "returns", "values", "entropy"):
            field = getattr(e, name)
            field[out] = 5.0 * torch.randn(int(out.sum()), generator=g)
    policy, critic = gradients(trainer, copy.deepcopy(experiences))
    policy_garbage, critic_garbage = gradients(trainer, garbage)
    assert policy.norm() > 0 and critic.norm() > 0
    # Equal up to summation order (the buffer shuffles micro-batches differently each update).
    assert relative(policy_garbage, policy) < 1e-6 and relative(critic_garbage, critic) < 1e-6
    changed = copy.deepcopy(experiences)
    first = next(e for e in changed if 0 in e.rollout.trained)
    k = first.rollout.trained.index(1)
    first.advantages[k] += 1.0
    first.returns[k] += 1.0
    policy_changed, critic_changed = gradients(trainer, changed)
    assert relative(policy_changed, policy) > 1e-3 and relative(critic_changed, critic) > 1e-3


def test_advantage_estimators_skip_observation_tokens():
    """Hand-computed: turn 1 = tokens 0-1, observation = 2-3, turn 2 = token 4, then padding."""
    mask = torch.tensor([[1.0, 1, 0, 0, 1, 0]])
    assert token_rewards(torch.tensor([2.0]), mask).tolist() == [[0, 0, 0, 0, 2.0, 0]]
    rewards = torch.tensor([[1.0, 0, 7, 7, 2, 7]])
    assert discounted_returns(rewards, mask, 0.5).tolist() == [[1.5, 1.0, 0, 0, 2.0, 0]]
    values = torch.tensor([[0.1, 0.2, 9, 9, 0.3, 9]])
    advantages, returns = gae_advantages(rewards, values, mask, 1.0, 1.0)
    # A4 = 2 - 0.3; A1 = (0 + 0.3 - 0.2) + A4; A0 = (1 + 0.2 - 0.1) + A1
    torch.testing.assert_close(advantages, torch.tensor([[2.9, 1.8, 0, 0, 1.7, 0]]))
    torch.testing.assert_close(returns, torch.tensor([[3.0, 2.0, 0, 0, 2.0, 0]]))


MULTI_TURN_CHANGES = {
    "rollout.environment": "rollout.environment=''",
    "rollout.environment_args": "rollout.environment_args={reply: 'No.', turns: 3}",
    "rollout.max_turns": "rollout.max_turns=2",
    "rollout.max_trajectory_tokens": "rollout.max_trajectory_tokens=30",
    "rollout.environment_timeout_s": "rollout.environment_timeout_s=0.01",
}


@pytest.mark.parametrize("key", sorted(MULTI_TURN_CHANGES))
def test_multi_turn_keys_change_the_step(key, warm_text, addition_data, tmp_path, world_of_one):
    """No dead options: each multi-turn key changes what one training step does (the timeout
    against an environment that takes 0.05 s for a first step: every trajectory fails there)."""
    from tests.unit.test_config_wiring import flat_parameters

    def update(extra):
        (tmp_path / str(len(extra))).mkdir()
        trainer = build(warm_text, addition_data, tmp_path / str(len(extra)), [
            "rollout.environment_args={reply: 'Check it again.', turns: 3, delay: 0.05}", "train.lr=0.001", *extra])
        torch.manual_seed(0)
        before = flat_parameters(trainer)
        metrics = trainer.train_step()
        return flat_parameters(trainer) - before, metrics

    baseline, metrics = update([])
    assert metrics["rollout/turns"] > 1.5 and metrics["rollout/environment_failures"] == 0
    changed, changed_metrics = update([MULTI_TURN_CHANGES[key]])
    assert not torch.allclose(changed, baseline, rtol=1e-3, atol=1e-7), key
    if key == "rollout.environment_timeout_s":
        assert changed_metrics["rollout/environment_failures"] == 12  # counted, and the step completed


def doc_block(containing: str) -> str:
    """The python block of docs/environments.md that contains `containing`, dedented."""
    import re
    import textwrap
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "environments.md").read_text()
    return next(textwrap.dedent(b) for b in re.findall(r"```python\n(.*?)```", doc, re.DOTALL) if containing in b)


def test_the_documented_environment_and_tool_run(warm_text, addition_data, tmp_path, world_of_one):
    """docs/environments.md's worked example: its environment behaves as written and trains as
    `rollout.environment: file.py:Class`; its tool answers through the `tools` environment."""
    from vlrft.multiturn.tools import ToolEnvironment

    (tmp_path / "guess.py").write_text(doc_block("class GuessTheNumber"))
    (tmp_path / "letters.py").write_text(doc_block("def letters"))
    env = resolve_environment(f"{tmp_path / 'guess.py'}:GuessTheNumber")()
    env.reset({"answer": "7"})
    assert env.step("<answer>5</answer>").observation == "higher" and env.step("9").observation == "lower"
    last = env.step("It is 7.")
    assert last.reward == 1.0 and last.done
    tools = ToolEnvironment([f"{tmp_path / 'letters.py'}:letters"])
    assert tools.step('<tool_call>{"name": "letters", "arguments": {"word": "tiny"}}</tool_call>').observation == "t i n y"
    trainer = build_trainer(warm_text, addition_data, tmp_path, [
        f"rollout.environment={tmp_path / 'guess.py'}:GuessTheNumber", "rollout.max_turns=3",
        "rollout.max_new_tokens=12", "rollout.max_trajectory_tokens=80",
        "reward.default=[{recipe: exact_match}, {recipe: environment_reward}]",
    ])
    metrics = trainer.train_step()
    assert metrics["rollout/turns"] > 1.0 and metrics["rollout/environment_failures"] == 0


def test_saved_trajectories_carry_turns_and_the_trained_mask(made, tmp_path):
    import json

    from vlrft.trajectory.saver import TrajectorySaver

    trainer, experiences, _ = made
    path = TrajectorySaver(tmp_path, 0, trainer.encoder.tokenizer, 1).save(3, experiences, [0.0] * len(experiences))
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for record, e in zip(records, experiences):
        assert record["trained"] == e.rollout.trained and len(record["trained"]) == len(record["response_tokens"])
        assert [t["action"] for t in record["turns"]] == [t["action"] for t in e.rollout.turns]
        trained = torch.tensor(e.rollout.trained, dtype=torch.bool)
        assert record["advantage"] == pytest.approx(float(e.advantages[trained].mean()), abs=1e-4)
        shown = record.get("observation_images", [])
        assert len(shown) == len(e.rollout.observation_images) and all((path.parent / p).is_file() for p in shown)
    assert any("observation_images" in r for r in records) == (trainer.encoder.image_processor is not None)


def test_shared_first_turn_prompts_give_the_unshared_numbers(made):
    """Multi-turn samples share their first turn's prompt; a response holding observation images
    keeps them, with the M-RoPE ids of its whole sequence. Logprobs, entropies and values equal
    the unshared layout's."""
    from vlrft.models.forward import policy_forward
    from vlrft.models.packing import pack
    from vlrft.models.value_model import token_values

    trainer, experiences, _ = made
    found = []
    for share in (False, True):
        batch = pack(experiences, share=share)
        assert batch.shares_prompts() == share
        with torch.no_grad():
            out = policy_forward(trainer.backend.model, batch, trainer.cfg.rollout.temperature)
            values = token_values(trainer.critic.model, batch)
        rows = zip(*(gather_responses(batch, t) for t in (out.logp, out.entropy, values)))
        found.append({id(e): r for e, r in zip(batch.samples, rows)})
    assert any(e.rollout.observation_images for e in experiences) == (trainer.encoder.image_processor is not None)
    for key, rows in found[0].items():
        for a, b in zip(rows, found[1][key]):
            assert (a - b).abs().max() <= 1e-5
