"""A remote teacher (`teacher.url`, `vlrft teacher-server`, served here in a thread on loopback)
gives the local teacher's rows and distillation metrics to 1e-5: text, one image, two images,
a multi-turn response with an observation image, shared prompts, a step cut into several
requests, and a whole training step. The server rebuilds exactly the trainer's pixel inputs,
refuses hostile requests with one JSON line each, and an unreachable or refusing server is one
line naming the URL."""

import contextlib
import json
import threading
import urllib.error
import urllib.request
from dataclasses import replace

import pytest
import torch
from PIL import Image

from tests.conftest import make_mixed_rollouts
from tests.ports import free_port
from tests.unit.test_shared_prefix import groups_of
from vlrft.config import load_config
from vlrft.data.encoding import IMAGE_PAD, PromptEncoder
from vlrft.engines.base import SamplingParams
from vlrft.errors import ConfigError
from vlrft.experience.distillation import DistillSettings, distill_experiences
from vlrft.experience.maker import FastExperienceMaker, MakerSettings
from vlrft.models.loader import load_model
from vlrft.models.remote_teacher import RemoteTeacherError, connect, remote_teacher_problem
from vlrft.models.teacher_server import Teacher, teacher_server
from vlrft.models.teacher_server_cli import TOKEN_ENV, TeacherOptions
from vlrft.models.teacher_wire import RequestLimits, check_logprobs_request, logprob_requests
from vlrft.rewards.server_checks import Limits, ListenOptions
from vlrft.rewards.wire import encode_image
from vlrft.types import Experience

TEMPERATURE = 0.7
MIN_PIXELS, MAX_PIXELS = 56 * 56, 112 * 112  # as make_mixed_rollouts' encoder


@contextlib.contextmanager
def served(model: str, token: str | None = None, limits: Limits = Limits(), max_tokens: int = 65536):
    """A teacher server for `model` on a free loopback port, in a thread: (its URL, its Teacher)."""
    options = TeacherOptions(model=model, max_tokens=max_tokens, micro_batch_tokens=256,
                             listen=ListenOptions(port=free_port(), token=token, limits=limits))
    teacher = Teacher(options)
    server = teacher_server(teacher)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{options.listen.port}", teacher
    finally:
        server.close()
        thread.join(timeout=10)


def remote_config(student: str, data, url: str, *extra: str):
    return load_config(None, [f"model.path={student}", f"data.train_path={data / 'train.jsonl'}", f"teacher.url={url}",
                              "data.max_prompt_tokens=200", "rollout.max_new_tokens=56", f"data.min_pixels={MIN_PIXELS}",
                              f"data.max_pixels={MAX_PIXELS}", "teacher.retries=1", "teacher.timeout_s=20", *extra])


def with_observation_image(rollout, model_path):
    """`rollout` as a multi-turn response: 5 generated tokens, an observation showing an image
    (its pads; out of the trained tokens), 5 more generated tokens."""
    encoder = PromptEncoder(model_path, MIN_PIXELS, MAX_PIXELS, 512)
    image = Image.new("RGB", (200, 150), (20, 200, 90))  # over max_pixels: the processor shrinks it
    mm_inputs = encoder.image_inputs([image], "observation")
    pads = encoder.tokenizer(encoder.expand_image_pads(IMAGE_PAD, mm_inputs, "", 1), add_special_tokens=False)["input_ids"]
    generated = rollout.response_ids[:5]
    response = generated + pads + generated
    return replace(rollout, response_ids=response, trained=[1] * 5 + [0] * len(pads) + [1] * 5,
                   observation_images=[image], observation_mm_inputs=mm_inputs,
                   response_mm_token_types=encoder.token_types(response))


def experience_rows(student, teacher, rollouts, share: bool) -> dict:
    """The experience pass's per-rollout rows ("old", "teacher", "teacher_top", ...)."""
    settings = MakerSettings(SamplingParams(n=1, max_new_tokens=64, temperature=TEMPERATURE), keep_per_prompt=1,
                             micro_batch_tokens=256, share_prompts=share, distill=DistillSettings("advantage", 1.0))
    maker = FastExperienceMaker(None, lambda: student, None, None, None, settings, teacher=teacher)
    return maker.forward_pass(rollouts)


def distilled(rollouts, rows):
    experiences = [Experience(r, 0.0, {}) for r in rollouts]
    width = max(len(r.response_ids) for r in rollouts)
    mask = torch.stack([torch.nn.functional.pad(r.trained_mask(), (0, width - len(r.response_ids))) for r in rollouts])
    return distill_experiences(DistillSettings("advantage", 1.0), experiences, rows, torch.zeros_like(mask), mask, 0.0)


def test_a_remote_teacher_gives_the_local_teachers_rows_and_metrics(tiny_vl, colour_data, tmp_path, world_of_one):
    from data_tools.make_tiny_model import build_vl_model

    student_path = str(build_vl_model(tmp_path / "student", warmup_steps=0, seed=1))
    mixed = make_mixed_rollouts(tiny_vl, colour_data, tmp_path)  # text, one image, two images
    rollouts = mixed + [with_observation_image(mixed[1], tiny_vl)] + groups_of(mixed[1:], 3)
    student, local = load_model(student_path).eval(), load_model(tiny_vl).eval()
    # --max-items 4, --max-tokens 400: the step takes several requests, some prompts in two of them
    with served(tiny_vl, limits=Limits(max_items=4), max_tokens=400) as (url, server):
        remote = connect(remote_config(student_path, colour_data, url))
        requests = logprob_requests(rollouts, TEMPERATURE, MIN_PIXELS, MAX_PIXELS, remote.limits)
        assert len(requests) >= 3
        for body, indices in requests:  # each within --max-tokens, a prompt counted with each of its samples
            assert sum(len(rollouts[i].prompt.prompt_ids) + len(rollouts[i].response_ids) for i in indices) <= 400
        for share in (False, True):
            want, got = experience_rows(student, local, rollouts, share), experience_rows(student, remote, rollouts, share)
            assert sum(len(row) for row in got["teacher"]) > 80
            for w, g, w_top, g_top in zip(want["teacher"], got["teacher"], want["teacher_top"], got["teacher_top"]):
                torch.testing.assert_close(g, w, rtol=0, atol=1e-5)  # (dtype and shape too)
                assert torch.equal(w_top, g_top)
            (want_adv, want_metrics), (got_adv, got_metrics) = distilled(rollouts, want), distilled(rollouts, got)
            assert (want_adv - got_adv).abs().max() <= 1e-5 and got_adv.abs().sum() > 0
            for key in ("distill/reverse_kl", "distill/teacher_argmax_match"):
                assert got_metrics[key] == pytest.approx(want_metrics[key], abs=1e-5), key

        # The server rebuilds exactly the trainer's inputs: token ids, pixel values, grids, modality ids
        body, indices = logprob_requests(rollouts, TEMPERATURE, MIN_PIXELS, MAX_PIXELS, RequestLimits(99, 9999, 2**24, 2**24))[0]
        rebuilt = server.rollouts(check_logprobs_request(json.loads(body), Limits(), 65536, 4096, server.vocab_size))
        for i, copy in zip(indices, rebuilt):
            sent = rollouts[i]
            assert copy.prompt.prompt_ids + copy.response_ids == sent.prompt.prompt_ids + sent.response_ids
            assert copy.mm_inputs().keys() == sent.mm_inputs().keys()
            assert all(torch.equal(copy.mm_inputs()[k], sent.mm_inputs()[k]) for k in sent.mm_inputs())
            assert copy.mm_token_types() == sent.mm_token_types()
        assert any("pixel_values" in copy.observation_mm_inputs for copy in rebuilt)


def post(url: str, body, token: str | None = None) -> tuple[int, str]:
    """(status, the one-line error or "") of a raw POST /logprobs."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url + "/logprobs", data=data, headers=headers), timeout=30) as r:
            json.loads(r.read())
            return r.status, ""
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())["error"]


def test_hostile_requests_get_one_json_line_each(tiny_vl, mixed_rollouts):
    limits = RequestLimits(99, 9999, 2**24, 2**24)
    body, _ = logprob_requests(mixed_rollouts, TEMPERATURE, MIN_PIXELS, MAX_PIXELS, limits)[0]
    good = json.loads(body)
    image_prompt = next(k for k, p in enumerate(good["prompts"]) if p["images"])

    def changed(**edits):
        request = json.loads(body)
        for path, value in edits.items():
            *where, last = path.split("__")
            target = request
            for key in where:
                target = target[int(key)] if key.isdigit() else target[key]
            target[int(last) if last.isdigit() else last] = value
        return request

    with served(tiny_vl, token="s3cret", max_tokens=600) as (url, server):
        assert post(url, good, "s3cret")[0] == 200
        assert post(url, good) == (401, "missing or wrong token: send 'Authorization: Bearer TOKEN'")
        vocab = server.vocab_size
        cases = {
            "samples__0__response_ids__0": (vocab, 422, f"sample 0 response_ids[0] is {vocab}, not a token id in [0, {vocab})"),
            "prompts__0__ids__2": (-1, 422, f"prompt 0 ids[2] is -1, not a token id in [0, {vocab})"),
            "samples__1__response_ids__3": (True, 422, f"sample 1 response_ids[3] is True, not a token id in [0, {vocab})"),
            "samples__0__prompt": (7, 422, "sample 0: 'prompt' must be the index of one of the 3 prompts"),
            "temperature": (0, 422, "temperature must be a number in [0.001, 1000], got 0"),
            "max_pixels": (2**30, 422, "min_pixels and max_pixels must be integers, 1 <= min_pixels <= max_pixels <= "
                                       f"{Limits().max_image_pixels} (--max-image-pixels)"),
            "samples__0__extra": (1, 422, "sample 0 has an unknown field 'extra'"),
            "samples__2__response_ids": (list(range(10, 600)), 413, "over the limit of 600 (--max-tokens)"),
            "samples__1__response_ids": (list(range(10, 260)), 413, "tokens, over the limit of 256 a sequence "
                                                                    "(--micro-batch-tokens)"),
            f"prompts__{image_prompt}__images": ([], 422, f"prompt {image_prompt} has 4 image tokens but its images give 0"),
        }
        for path, (value, status, message) in cases.items():
            answer = post(url, changed(**{path: value}), "s3cret")
            assert answer[0] == status and message in answer[1] and "\n" not in answer[1], (path, answer)
        assert post(url, changed(min_pixels=2**24, max_pixels=2**24), "s3cret") == (  # (upscaling counts too)
            413, f"3 images of min_pixels {2**24} each are over the limit of {2**25} pixels (--max-request-pixels)")
        larger = Image.new("RGB", (112, 112))  # more tokens than the prompt's pads: refused before decoding
        assert post(url, changed(**{f"prompts__{image_prompt}__images": [encode_image(larger)]}), "s3cret") == (
            422, f"prompt {image_prompt} has 4 image tokens but its images give 16 (min_pixels, max_pixels as the "
                 "trainer's data.min_pixels, data.max_pixels?)")
        # One prompt with many short responses: its tokens counted once would be under the limit,
        # but each micro-batch of its responses packs it again
        first = good["samples"][0]
        prompt_tokens = len(good["prompts"][first["prompt"]]["ids"])
        repeats = 600 // (prompt_tokens + len(first["response_ids"])) + 1
        listed = sum(len(p["ids"]) for p in good["prompts"]) + repeats * len(first["response_ids"])
        assert listed <= 600 and repeats * prompt_tokens > 256  # (more than one micro-batch of 256 tokens)
        many = dict(good, samples=[first] * repeats + good["samples"][1:])
        forward = sum(len(good["prompts"][x["prompt"]]["ids"]) + len(x["response_ids"]) for x in many["samples"])
        assert post(url, many, "s3cret") == (413, f"the request's samples hold {forward} tokens with their prompts "
                                                  "(each counted once a sample), over the limit of 600 (--max-tokens)")
        assert post(url, b'{"samples": [' * 40, "s3cret")[0] == 400
        ids = good["prompts"][image_prompt]["ids"]  # its image's 4 pads as two runs (the count unchanged)
        first = ids.index(server.image_check.image_token_id)
        split = ids[:first + 1] + [ids[first - 1]] + ids[first + 1:first + 4] + ids[first + 5:]
        assert post(url, changed(**{f"prompts__{image_prompt}__ids": split}), "s3cret") == (
            422, f"prompt {image_prompt}: its image tokens form runs of [1, 3] tokens, and its images give [4]: "
                 "each image's tokens must be one run, in the images' order")
        assert post(url, good, "s3cret")[0] == 200  # and it still serves


def test_unreachable_or_refusing_teacher_is_one_line(tiny_vl, colour_data, mixed_rollouts, monkeypatch, tmp_path,
                                                     world_of_one):
    from vlrft.trainer.spmd_trainer import SPMDTrainer

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    closed = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RemoteTeacherError) as err:  # at start, before any model loads
        SPMDTrainer(remote_config(tiny_vl, colour_data, closed, f"output.dir={tmp_path / 'run'}"))
    assert str(err.value).startswith(f"teacher.url {closed}/health: ") and "(after 2 attempts)" in str(err.value)
    assert "\n" not in str(err.value)
    with served(tiny_vl, token="s3cret") as (url, _):
        with pytest.raises(RemoteTeacherError, match=r"^teacher.url .*/health: HTTP 401: missing or wrong token: .*\(after 1 attempt\)$"):
            connect(remote_config(tiny_vl, colour_data, url))
        (tmp_path / "token").write_text("s3cret\n")
        remote = connect(remote_config(tiny_vl, colour_data, url, f"teacher.token_file={tmp_path / 'token'}"))
        monkeypatch.setenv(TOKEN_ENV, "s3cret")
        assert connect(remote_config(tiny_vl, colour_data, url)).limits == remote.limits
        logp, _ = remote.score(mixed_rollouts, TEMPERATURE)
    with pytest.raises(RemoteTeacherError) as err:  # the server went away during training
        remote.score(mixed_rollouts, TEMPERATURE)
    assert str(err.value).startswith(f"teacher.url {url}/logprobs: ") and "\n" not in str(err.value)
    assert [len(row) for row in logp] == [len(r.response_ids) for r in mixed_rollouts]


def test_timeout_and_deadline_bound_a_silent_server(tiny_vl, colour_data):
    import socket

    with socket.socket() as silent:  # accepts connections (the kernel's queue), never answers
        silent.bind(("127.0.0.1", free_port()))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(RemoteTeacherError, match=r"/health: timed out \(after 1 attempt\)$"):
            connect(remote_config(tiny_vl, colour_data, url, "teacher.timeout_s=0.2", "teacher.retries=0"))
        with pytest.raises(RemoteTeacherError, match=r"/health: timed out; deadline_s reached \(after 1 attempt\)$"):
            connect(remote_config(tiny_vl, colour_data, url, "teacher.timeout_s=0.2", "teacher.retries=5",
                                  "teacher.deadline_s=0.3"))


def test_a_teacher_that_cannot_score_the_student_is_refused_at_start(tiny_vl, tiny_text):
    from transformers import AutoTokenizer

    from vlrft.models.teacher_wire import vocab_digest

    health = {"vocab_sha256": vocab_digest(AutoTokenizer.from_pretrained(tiny_vl).get_vocab()), "vocab_size": 638,
              "vision": True, "max_sequence_tokens": 4096}
    url = "http://teacher:8001"

    def problem(student, **changed):
        return remote_teacher_problem(student, url, {**health, **changed}, longest=2048)

    assert problem(tiny_vl) == "" and problem(tiny_text, vision=False) == ""
    assert problem(tiny_vl, vision=False) == (
        f"teacher.url {url} serves a teacher with no vision tower, and model.path {tiny_vl} is a vision-language "
        "model: the teacher must see the student's images")
    assert problem(tiny_vl, vocab_sha256="0" * 64).startswith(
        f"teacher.url {url} serves a teacher whose tokenizer vocabulary differs from model.path {tiny_vl}'s")
    assert problem(tiny_vl, vocab_size=100) == (
        f"teacher.url {url} scores 100 token ids, fewer than the 638 model.path {tiny_vl} can sample")
    assert problem(tiny_vl, max_sequence_tokens=2000) == (
        f"teacher.url {url} scores sequences of at most 2000 tokens (its --micro-batch-tokens), and this run's reach "
        "2048 (data.max_prompt_tokens + the longest response)")


@pytest.mark.parametrize("overrides, message", [
    (["teacher.path=x", "teacher.url=http://t:1"], "config keys 'teacher.path' and 'teacher.url' are both set"),
    (["teacher.url=ftp://t:1"], "config key 'teacher.url' must be an http:// or https:// URL"),
    (["teacher.url=http://t:1", "teacher.compute_dtype=bfloat16"], "config key 'teacher.compute_dtype' applies to a local teacher"),
    (["teacher.path=x", "teacher.timeout_s=5"], "config key 'teacher.timeout_s' applies to a remote teacher: set teacher.url"),
    (["teacher.token_file=t"], "apply to on-policy distillation: set teacher.path or teacher.url"),
    (["teacher.url=http://t:1", "teacher.deadline_s=0"], "'teacher.deadline_s' must be > 0"),
])
def test_remote_teacher_config_checks(tiny_text, addition_data, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, [f"model.path={tiny_text}", f"data.train_path={addition_data / 'train.jsonl'}", *overrides])


def test_a_relative_token_file_is_relative_to_its_config(tiny_text, addition_data, tmp_path):
    (tmp_path / "run.yaml").write_text(f"model: {{path: {tiny_text}}}\ndata: {{train_path: {addition_data / 'train.jsonl'}}}\n"
                                       "teacher: {url: 'http://t:1', token_file: secrets/teacher-token}\n")
    assert load_config(tmp_path / "run.yaml").teacher.token_file == str(tmp_path / "secrets" / "teacher-token")


def test_the_cli_refuses_a_public_teacher_server_without_a_token(tiny_vl, capsys, monkeypatch):
    from vlrft.cli import main

    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert main(["teacher-server", "--model", tiny_vl, "--host", "0.0.0.0"]) == 2
    assert capsys.readouterr().err == (
        "vlrft: error: teacher server: --host 0.0.0.0 is not a loopback address, so a token is required: give "
        f"--token-file PATH or set {TOKEN_ENV} (clients send 'Authorization: Bearer TOKEN')\n")


def one_step(overrides):
    """The parameter change and the metrics of one training step (world of one)."""
    from vlrft.trainer.spmd_trainer import SPMDTrainer

    trainer = SPMDTrainer(load_config(None, overrides))
    before = torch.cat([p.detach().flatten().clone() for p in trainer.backend.module.parameters()])
    metrics = trainer.train_step()
    return torch.cat([p.detach().flatten() for p in trainer.backend.module.parameters()]) - before, metrics


def test_a_training_step_with_a_remote_teacher_is_the_local_teachers(tiny_text, addition_data, tmp_path, world_of_one):
    from data_tools.make_tiny_model import build_text_model

    teacher = str(build_text_model(tmp_path / "teacher", warmup_steps=0, seed=1))
    base = [f"model.path={tiny_text}", f"data.train_path={addition_data / 'train.jsonl'}", "rollout.rollout_prompts=2",
            "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=6", "train.lr=0.001", "train.total_steps=4",
            "reward.default=[]", "algo.kl.coef=0", "train.share_prompts=true", "data.max_prompt_tokens=200"]
    local, local_metrics = one_step(base + [f"teacher.path={teacher}", f"output.dir={tmp_path / 'local'}"])
    with served(teacher) as (url, _):
        remote, metrics = one_step(base + [f"teacher.url={url}", f"output.dir={tmp_path / 'remote'}"])
    assert local.abs().max() > 0 and (remote - local).abs().max() <= 1e-5
    for key in ("distill/reverse_kl", "distill/teacher_argmax_match"):
        assert metrics[key] == pytest.approx(local_metrics[key], abs=1e-5) and metrics[key] != 0, key
    assert metrics["distill/teacher_seconds"] > 0
