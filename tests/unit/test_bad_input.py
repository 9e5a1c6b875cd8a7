"""The bad-input matrix (issue 8) in one process (a world of one).

Under `data.on_bad_sample: error` each bad row or prompt stops the run with its one-line
message; under `skip` it is left out, named in one printed line and counted
(`data/skipped_rows`, `data/skipped_prompts`) while training goes on. An oversized image is
bounded by the encoder, an empty completion trains without NaN, and a non-finite loss skips the
optimizer step leaving parameters and AdamW state bit-identical.
"""

import io
import json
import re
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from vlrft.config import ConfigError, load_config
from vlrft.data.dataset import DataError
from vlrft.data.encoding import PromptEncoder
from vlrft.data.sampler import PromptSampler

# Rewards that vary within a group even for an untrained model, so advantages are non-zero.
RECIPE = "def distinct_chars(completions, samples):\n    return [len(set(c)) / 10 for c in completions]\n"
QUESTION = "What colour is the shape? Answer as <answer>colour</answer>."
BOMB_LIMIT = 4000  # PIL.Image.MAX_IMAGE_PIXELS in these tests: the 56x56 task images pass, 100x100 does not
MAX_PROMPT_TOKENS = 60  # the task's prompts have 27 tokens


def vl_row(row_id: str, image, text: str = QUESTION) -> dict:
    return {"id": row_id, "answer": "red", "data_source": "color_shapes", "meta": {},
            "messages": [{"role": "user", "content": [{"type": "image", "image": str(image)}, {"type": "text", "text": text}]}]}


def write_jsonl(path, lines) -> None:
    """Rows (dicts) as JSON lines; bytes are written as they are (a line that is bad on purpose)."""
    path.write_bytes(b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines))


@pytest.fixture
def bomb_limit(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", BOMB_LIMIT)


@pytest.fixture(scope="module")
def files(tmp_path_factory, colour_data):
    """Bad images and the encode-time cases: kind -> (row, its exact error message as a regex)."""
    root = tmp_path_factory.mktemp("bad_input")
    (root / "recipe.py").write_text(RECIPE)
    good = root / "good.png"  # beside the bad images: the test files list `root` in data.media_roots
    shutil.copy(colour_data / "images" / "train_00000.png", good)
    (root / "not_image.png").write_bytes(b"this is not a PNG file")
    noise = Image.fromarray(np.random.default_rng(0).integers(0, 255, (56, 56, 3), dtype=np.uint8))
    buffer = io.BytesIO()
    noise.save(buffer, format="PNG")
    (root / "truncated.png").write_bytes(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    Image.new("RGB", (100, 100), (255, 0, 0)).save(root / "bomb.png")  # 10000 px > 2 x BOMB_LIMIT
    cases = {
        "not_image": (vl_row("bad-not_image", root / "not_image.png"), re.escape(
            f"row id 'bad-not_image': cannot read image {root / 'not_image.png'} "
            "(cannot identify image file as PNG, JPEG or WEBP, the image formats read)")),
        "truncated": (vl_row("bad-truncated", root / "truncated.png"), re.escape(
            f"row id 'bad-truncated': cannot read image {root / 'truncated.png'} (image file is truncated)")),
        "bomb": (vl_row("bad-bomb", root / "bomb.png"), re.escape(
            f"row id 'bad-bomb': cannot read image {root / 'bomb.png'} (Image size (10000 pixels) exceeds limit "
            f"of {2 * BOMB_LIMIT} pixels, could be decompression bomb DOS attack.)")),
        "too_long": (vl_row("bad-too_long", good, QUESTION + " and some more words" * 40),
                     rf"row id 'bad-too_long': prompt has \d+ tokens > data\.max_prompt_tokens={MAX_PROMPT_TOKENS}"),
    }
    return root, good, cases  # kind -> (row, its one-line message as a regex)


def overrides(model, train_path, out_dir, *extra) -> list[str]:
    return [
        f"model.path={model}", f"data.train_path={train_path}", f"output.dir={out_dir}",
        "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=4", "eval.every_steps=0",
        f"data.max_prompt_tokens={MAX_PROMPT_TOKENS}", *extra,
    ]


def build(args):
    from vlrft.trainer.spmd_trainer import SPMDTrainer

    return SPMDTrainer(load_config(None, args))


def flat(module) -> torch.Tensor:
    return torch.cat([p.detach().flatten().clone() for p in module.parameters()])


def test_on_bad_sample_is_validated(tiny_text, addition_data):
    with pytest.raises(ConfigError, match=r"^config key 'data.on_bad_sample' is 'ignore'; valid: error, skip$"):
        load_config(None, [f"model.path={tiny_text}", f"data.train_path={addition_data / 'train.jsonl'}",
                           "data.on_bad_sample=ignore"])


# ---- load time: one bad line (line 2) of a file whose line 1 is good -----------------------

def load_cases(root, good):
    missing = root / "missing.png"
    return {
        "invalid JSON": (b'{"id": "x",', "{path}:2: invalid JSON (Expecting property name enclosed in double quotes)"),
        "not UTF-8": (b'{"id": "\xff"}', "{path}:2: invalid JSON (not UTF-8 text)"),
        "not an object": (b"[1, 2]", "{path}:2: a row must be a JSON object"),
        "missing field": ({"id": "nofield", "messages": [{"role": "user", "content": "hi"}]},
                          "{path}:2 (row id 'nofield'): missing required field 'answer'"),
        "missing image": (vl_row("noimage", missing), f"{{path}}:2 (row id 'noimage'): image file not found: {missing}"),
    }


@pytest.mark.parametrize("case", ["invalid JSON", "not UTF-8", "not an object", "missing field", "missing image"])
def test_bad_row_stops_the_run_naming_file_and_line(case, files, tiny_vl, world_of_one, tmp_path):
    root, good, _ = files
    bad, message = load_cases(root, good)[case]
    path = tmp_path / "train.jsonl"
    write_jsonl(path, [vl_row("good", good), bad])
    with pytest.raises(DataError, match=f"^{re.escape(message.format(path=path))}$"):
        build(overrides(tiny_vl, path, tmp_path / "run", f"data.media_roots=[{root}]"))


def test_a_file_of_bad_rows_is_an_error_even_when_skipping(files, tiny_vl, world_of_one, tmp_path):
    path = tmp_path / "train.jsonl"
    write_jsonl(path, [b"not json", b"[1]"])
    message = f"dataset file {path} has no valid rows (2 bad, first: {path}:1: invalid JSON (Expecting value))"
    with pytest.raises(DataError, match=f"^{re.escape(message)}$"):
        build(overrides(tiny_vl, path, tmp_path / "run", "data.on_bad_sample=skip"))


# ---- encode time: images that do not decode, prompts too long ------------------------------

def test_bad_prompt_stops_the_step_with_its_message(files, tiny_vl, world_of_one, bomb_limit, tmp_path):
    root, good, cases = files
    kinds = sorted(cases)
    sampler = PromptSampler(len(kinds) + 1, 1, 0, 1, seed=0)
    drawn = [sampler.next_indices()[0][1] for _ in kinds]  # the row each of the first steps draws
    rows = [vl_row(f"good-{i}", good) for i in range(len(kinds) + 1)]
    for kind, index in zip(kinds, drawn):
        rows[index] = cases[kind][0]
    write_jsonl(tmp_path / "train.jsonl", rows)
    trainer = build(overrides(tiny_vl, tmp_path / "train.jsonl", tmp_path / "run", "rollout.rollout_prompts=1",
                              f"data.media_roots=[{root}]"))
    for kind in kinds:  # the step stops before anything is generated; the next step draws the next row
        with pytest.raises(DataError, match=f"^{cases[kind][1]}$"):
            trainer.train_step()


def test_bad_eval_prompt_stops_the_run_at_start(files, tiny_vl, world_of_one, tmp_path):
    root, good, cases = files
    write_jsonl(tmp_path / "train.jsonl", [vl_row("good", good)])
    write_jsonl(tmp_path / "eval.jsonl", [vl_row("good", good), cases["not_image"][0]])
    with pytest.raises(DataError, match=f"^{cases['not_image'][1]}$"):
        build(overrides(tiny_vl, tmp_path / "train.jsonl", tmp_path / "run", f"data.eval_path={tmp_path / 'eval.jsonl'}",
                        f"data.media_roots=[{root}]"))


def test_skip_counts_bad_rows_and_prompts_and_trains_on(files, tiny_vl, world_of_one, bomb_limit, tmp_path, capsys):
    """6 loadable rows, 2 prompts a step: step 1 draws two bad prompts (this rank has nothing
    left: a placeholder keeps it going), steps 2 and 3 one bad and one good each."""
    root, good, cases = files
    sampler = PromptSampler(6, 2, 0, 1, seed=0)
    steps = [[row for _, row in sampler.next_indices()] for _ in range(3)]
    bad_at = {steps[0][0]: "not_image", steps[0][1]: "truncated", steps[1][0]: "too_long", steps[2][0]: "bomb"}
    rows = [cases[bad_at[i]][0] if i in bad_at else vl_row(f"good-{i}", good) for i in range(6)]
    train, evaluation = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    write_jsonl(train, rows + [bad for bad, _ in load_cases(root, good).values()])  # + 5 rows bad at load time
    write_jsonl(evaluation, [vl_row("eval-good", good), vl_row("eval-bad", root / "not_image.png"), b"{"])
    trainer = build(overrides(
        tiny_vl, train, tmp_path / "run", "data.on_bad_sample=skip", "rollout.rollout_prompts=2", "train.lr=0.01",
        f"data.media_roots=[{root}]",
        f"data.eval_path={evaluation}", f"reward.default=[{{recipe: '{root / 'recipe.py'}:distinct_chars'}}]",
    ))
    assert len(trainer.train_rows) == 6 and len(trainer.eval_prompts) == 1
    before = flat(trainer.backend.module)
    first = trainer.train_step()
    assert first["data/skipped_rows"] == 5 + 1 + 1  # train file, eval file, eval prompt that does not encode
    assert first["data/skipped_prompts"] == 2
    assert first["rollout/response_length"] == 0 and first["train/skipped_nonfinite_steps"] == 0
    assert torch.equal(flat(trainer.backend.module), before)  # nothing to learn from: no update
    for _ in range(2):
        before = flat(trainer.backend.module)
        metrics = trainer.train_step()
        assert "data/skipped_rows" not in metrics and metrics["data/skipped_prompts"] == 1
        assert metrics["rollout/response_length"] > 0 and metrics["train/grad_norm"] > 0
        assert not torch.equal(flat(trainer.backend.module), before)
    out = capsys.readouterr().out
    assert f"vlrft: skipped 5 bad rows of {train} (on_bad_sample: skip)\n" in out
    assert f"vlrft: skipped 1 bad rows of {evaluation} (on_bad_sample: skip)\n" in out
    assert f"vlrft: skipping {train}:9: a row must be a JSON object (on_bad_sample: skip)\n" in out
    for kind in ["not_image", "truncated", "too_long", "bomb"]:
        assert re.search(f"^vlrft: skipping {cases[kind][1]} \\(on_bad_sample: skip\\)$", out, re.M), kind
    assert "row id 'eval-bad': cannot read image" in out


# ---- images the encoder must bound or refuse -----------------------------------------------

def test_oversized_image_is_resized_into_the_pixel_bounds(tiny_vl, tmp_path):
    Image.new("L", (6000, 6000), 128).save(tmp_path / "huge.png", compress_level=1)
    encoder = PromptEncoder(tiny_vl, min_pixels=56 * 56, max_pixels=112 * 112, max_prompt_tokens=512)
    prompt = encoder.encode(vl_row("huge", tmp_path / "huge.png"), 0)
    patch = encoder.image_processor.patch_size
    pixels = int(prompt.mm_inputs["image_grid_thw"].prod()) * patch * patch
    assert 56 * 56 <= pixels <= 112 * 112


def test_decompression_bomb_and_extreme_aspect_ratio_are_data_errors(tiny_vl, tmp_path, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", BOMB_LIMIT)
    encoder = PromptEncoder(tiny_vl, min_pixels=56 * 56, max_pixels=112 * 112, max_prompt_tokens=512)
    Image.new("RGB", (70, 70)).save(tmp_path / "warned.png")  # over the limit: PIL would only warn
    with pytest.raises(DataError, match=r"^row id 'w': cannot read image .*warned.png \(Image size \(4900 pixels\) "
                                        r"exceeds limit of 4000 pixels, could be decompression bomb DOS attack.\)$"):
        encoder.encode(vl_row("w", tmp_path / "warned.png"), 0)
    Image.new("RGB", (1000, 4)).save(tmp_path / "strip.png")  # 4000 px: under the limit
    with pytest.raises(DataError, match=r"^row id 's': cannot use its image \(absolute aspect ratio must be smaller than 200"):
        encoder.encode(vl_row("s", tmp_path / "strip.png"), 0)


# ---- non-finite loss: the optimizer step is skipped, nothing changes ---------------------------

class FixedBuffer:
    """A replay buffer whose micro-batches are one experience each, in order (no shuffle)."""

    def __init__(self, experiences):
        self.experiences = experiences

    def mini_batches(self, count, shuffle):
        from vlrft.models.packing import pack

        return [[pack([e]) for e in self.experiences]]  # one mini-batch, in order


def update_backend_and_state(backend):
    """(full parameters, AdamW state tensors): what a skipped step must leave bit-identical."""
    optimizer = backend.engine.optimizer
    optimizer = getattr(optimizer, "optimizer", optimizer)  # ZeRO wraps the torch AdamW
    params = [t.clone() for _, t in backend.named_full_parameters()]
    state = [v.clone() for s in optimizer.state.values() for _, v in sorted(s.items()) if torch.is_tensor(v)]
    return params, state


def assert_identical(a, b):
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_nonfinite_loss_skips_the_step_and_leaves_parameters_and_adam_state(
    zero_stage, tiny_text, addition_data, world_of_one, capsys
):
    from vlrft.backends.deepspeed_backend import DeepSpeedBackend
    from vlrft.data.dataset import load_rows
    from vlrft.models.loader import load_model
    from vlrft.trainer.build import update_settings
    from vlrft.trainer.update import policy_update
    from vlrft.types import Experience, Rollout

    encoder = PromptEncoder(tiny_text, 3136, 12544, 1024)
    prompts = [encoder.encode(row, i) for i, row in enumerate(load_rows(addition_data / "train.jsonl")[:2])]
    cfg = load_config(None, [f"model.path={tiny_text}", f"data.train_path={addition_data / 'train.jsonl'}"])

    def experiences(nan_in_second: bool = False):
        out = []
        for i, prompt in enumerate(prompts):
            advantages = torch.tensor([1.0, -1.0, 0.5])
            if nan_in_second and i == 1:  # the first micro-batch's gradients are accumulated by then
                advantages[1] = float("nan")
            rollout = Rollout(prompt=prompt, group_id=i, response_ids=[5, 6, 7], response_text="", truncated=False)
            out.append(Experience(rollout, 0.0, {}, old_logprobs=torch.full((3,), -6.0), advantages=advantages))
        return out

    def backend():
        return DeepSpeedBackend(load_model(tiny_text), lr=1e-2, weight_decay=0.1, grad_clip=1.0, zero_stage=zero_stage)

    skipped = backend()
    policy_update(skipped, FixedBuffer(experiences()), update_settings(cfg))  # AdamW state exists from here on
    before = update_backend_and_state(skipped)
    assert before[1], "no AdamW state to compare"
    metrics = policy_update(skipped, FixedBuffer(experiences(nan_in_second=True)), update_settings(cfg))
    assert metrics["train/skipped_nonfinite_steps"] == 1 and "train/loss" not in metrics
    after = update_backend_and_state(skipped)
    assert_identical(after[0], before[0])
    assert_identical(after[1], before[1])
    assert "vlrft: skipped a policy optimizer step: non-finite loss in 1 micro-batch(es) on rank 0; " in capsys.readouterr().out
    # The next step trains as if the skipped one never happened: no gradient, optimizer step
    # count or lr-schedule step leaked from it.
    assert policy_update(skipped, FixedBuffer(experiences()), update_settings(cfg))["train/skipped_nonfinite_steps"] == 0
    clean = backend()
    for _ in range(2):
        policy_update(clean, FixedBuffer(experiences()), update_settings(cfg))
    mine, reference = update_backend_and_state(skipped), update_backend_and_state(clean)
    assert_identical(mine[0], reference[0])
    assert_identical(mine[1], reference[1])
    assert not all(map(torch.equal, mine[0], before[0]))  # and that step did train


def test_nonfinite_policy_and_value_loss_skip_both_steps_then_training_goes_on(files, tiny_text, addition_data,
                                                                                world_of_one, tmp_path, monkeypatch):
    import vlrft.trainer.critic_update as critic_module
    import vlrft.trainer.update as update_module

    root = files[0]
    trainer = build(overrides(
        tiny_text, addition_data / "train.jsonl", tmp_path / "run", "rollout.rollout_prompts=2",
        "algo.advantage=gae", "critic.enabled=true", "critic.lr=0.01", "train.lr=0.01",
        f"reward.default=[{{recipe: '{root / 'recipe.py'}:distinct_chars'}}]",
    ))
    def nan_on_first_call(real):  # the test-only injection: step 1's losses become NaN
        calls = []

        def loss(*args, **kwargs):
            out = real(*args, **kwargs)
            calls.append(1)
            if len(calls) > 1:
                return out
            return (out[0] * float("nan"), out[1]) if isinstance(out, tuple) else out * float("nan")
        return loss

    monkeypatch.setattr(update_module, "policy_loss", nan_on_first_call(update_module.policy_loss))
    monkeypatch.setattr(critic_module, "value_loss", nan_on_first_call(critic_module.value_loss))
    actor, critic = flat(trainer.backend.module), flat(trainer.critic.module)
    metrics = trainer.train_step()
    assert metrics["train/skipped_nonfinite_steps"] == 1 and metrics["critic/skipped_nonfinite_steps"] == 1
    assert torch.equal(flat(trainer.backend.module), actor) and torch.equal(flat(trainer.critic.module), critic)
    metrics = trainer.train_step()
    assert metrics["train/skipped_nonfinite_steps"] == 0 and metrics["critic/skipped_nonfinite_steps"] == 0
    assert not torch.equal(flat(trainer.backend.module), actor) and not torch.equal(flat(trainer.critic.module), critic)


# ---- empty completions: zero tokens, or tokens that decode to "" ------------------------------

RECIPE_KWARGS = {"soft_overlong_penalty": {"max_tokens": 4, "cache_tokens": 2}}


@pytest.mark.parametrize("name", ["exact_match", "answer_format", "think_answer_format", "math_accuracy",
                                  "multiple_choice", "counting", "grounding_iou", "soft_overlong_penalty",
                                  "repetition_penalty", "code_unit_tests"])
def test_builtin_recipes_score_an_empty_completion(name):
    from vlrft.rewards.loading import resolve_recipe

    answer = "[0, 0, 1, 1]" if name == "grounding_iou" else "3"
    samples = [{"id": "e", "answer": answer, "data_source": "d", "meta": {"tests": "assert True"}, "messages": [],
                "prompt": "q", "images": [], "response_ids": [], "response_length": 0, "truncated": False}] * 2
    scores = resolve_recipe(name)(["", ""], samples, **RECIPE_KWARGS.get(name, {}))
    assert len(scores) == 2
    assert all(s is None or np.isfinite(float(s)) for s in scores), scores


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"])
def test_advantages_of_empty_responses_are_finite(estimator):
    from vlrft.algo.estimate import AdvantageOptions, estimate_advantages

    mask = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]])  # rows 0, 2 empty
    values = torch.ones(4, 3) if estimator == "gae" else None
    advantages, returns = estimate_advantages(AdvantageOptions(name=estimator), torch.tensor([0.0, 1.0, 0.5, 0.0]),
                                              torch.tensor([0, 0, 1, 1]), mask, torch.zeros(4, 3), values)
    assert torch.isfinite(advantages).all() and (advantages[[0, 2]] == 0).all()
    assert returns is None or torch.isfinite(returns).all()


def test_empty_completions_go_through_rewards_experience_pass_and_update(files, tiny_text, addition_data,
                                                                         world_of_one, tmp_path):
    from vlrft.experience.maker import completion_fields
    from vlrft.experience.replay_buffer import ReplayBuffer
    from vlrft.models.loader import stop_token_ids
    from vlrft.trainer.build import update_settings
    from vlrft.trainer.update import policy_update
    from vlrft.types import Experience, Rollout

    root = files[0]
    trainer = build(overrides(
        tiny_text, addition_data / "train.jsonl", tmp_path / "run", "rollout.rollout_prompts=2", "algo.kl.coef=0.1",
        "algo.entropy_coef=0.01", "train.micro_batch_tokens=1", "train.ppo_epochs=2",  # the pass computes old logprobs  # one sequence per micro-batch: some score nothing
        f"reward.default=[{{recipe: '{root / 'recipe.py'}:distinct_chars'}}, {{recipe: exact_match}}]",
    ))
    eos = stop_token_ids(trainer.encoder.tokenizer)[0]
    prompts = [trainer.encoder.encode(row, i) for i, row in enumerate(trainer.train_rows[:2])]
    digits = trainer.encoder.tokenizer("12", add_special_tokens=False)["input_ids"]
    responses = [(prompts[0], [], ""), (prompts[0], [eos], ""), (prompts[1], [], ""), (prompts[1], digits + [eos], "12")]
    rollouts = [Rollout(p, p.index, ids, text, truncated=False) for p, ids, text in responses]
    totals, components, dense = trainer.rewards.score([r.response_text for r in rollouts],
                                                      [completion_fields(r) for r in rollouts])
    scored = [Experience(r, totals[i], components[i], dense[i]) for i, r in enumerate(rollouts)]
    experiences, kl_metrics = trainer.maker.finish(scored)
    assert all(np.isfinite(v) for v in kl_metrics.values())
    for e in experiences:
        for field in ("old_logprobs", "ref_logprobs", "advantages", "entropy"):
            value = getattr(e, field)
            assert value.shape == (len(e.rollout.response_ids),) and torch.isfinite(value).all(), field
    buffer = ReplayBuffer(trainer.cfg.train.micro_batch_tokens, seed=0)
    buffer.add(experiences)
    for mode in ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]:
        for loss in ["ppo", "gspo"]:
            trainer.cfg.algo.loss_agg_mode, trainer.cfg.algo.policy_loss = mode, loss
            metrics = policy_update(trainer.backend, buffer, update_settings(trainer.cfg), 0.1, trainer.reference)
            assert metrics["train/skipped_nonfinite_steps"] == 0, (mode, loss)
            assert all(np.isfinite(v) for v in metrics.values()), (mode, loss, metrics)
    assert torch.isfinite(flat(trainer.backend.module)).all()


def test_bad_ptx_rows_are_skipped_and_counted(files, tiny_vl, world_of_one):
    from vlrft.data.ptx import PtxStream
    from vlrft.trainer.bad_input import BadInput

    root, good, cases = files
    write_jsonl(root / "ptx.jsonl", [vl_row("ptx-good", good), cases["not_image"][0], b"[]"])
    encoder = PromptEncoder(tiny_vl, 3136, 12544, MAX_PROMPT_TOKENS)
    with pytest.raises(DataError, match=f"^{re.escape(str(root / 'ptx.jsonl'))}:3: a row must be a JSON object$"):
        PtxStream(str(root / "ptx.jsonl"), encoder, 2, 0, 1, 0, BadInput("error", 0, 1))
    bad_input = BadInput("skip", 0, 1)
    stream = PtxStream(str(root / "ptx.jsonl"), encoder, 2, 0, 1, 0, bad_input)
    assert [e.prompt.id for e in stream.examples] == ["ptx-good"] and bad_input.skipped_rows == 2
