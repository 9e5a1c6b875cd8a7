"""`vlrft teacher-server`: an on-policy distillation teacher served over HTTP, so that the ranks
that train need not hold it (`teacher.url`, vlrft.models.remote_teacher).

  GET  /health   -> {"status": "ok", "vocab_sha256", "vocab_size", "vision", and the request limits}
  POST /logprobs -> vlrft.models.teacher_wire's request -> {"logprobs": [[...]], "argmax": [[...]]}

The teacher scores with the trainer's own function (models/forward.teacher_scores) on packed
micro-batches of --micro-batch-tokens (each prompt once for its responses; no sequence longer),
one forward at a time, so its logprobs are the local teacher's. It rebuilds each sample as the trainer holds it:
the prompt's images through its own image processor with the request's min/max pixels, each
token's modality id from its id. It has the reward server's guards (server_common, server_http,
server_checks: the token, loopback-only without one, no web pages, JSON only, body and JSON
limits, one-line JSON errors) and its own: every id in its vocabulary, at most --max-tokens
tokens a request, each image's tokens counted from its header and matched against the
prompt's image pads before any image is decoded.
"""

from __future__ import annotations

import copy
import threading

from flask import Flask, jsonify

from vlrft.data.dataset import DataError
from vlrft.data.encoding import PromptEncoder
from vlrft.errors import ConfigError
from vlrft.experience.checks import ImageTokenCheck
from vlrft.models.attention import precision_config_problem, resolve_attention
from vlrft.models.collate import gather_responses
from vlrft.models.forward import teacher_scores
from vlrft.models.hub import local_model_dir
from vlrft.models.packing import pack, split_by_token_budget
from vlrft.models.teacher import load_teacher
from vlrft.models.teacher_server_cli import TOKEN_ENV, TeacherOptions
from vlrft.models.teacher_wire import LogprobsRequest, check_logprobs_request, vocab_digest
from vlrft.models.vision_calls import declare_modalities
from vlrft.rewards.server_checks import Rejected, check_bind
from vlrft.rewards.server_common import answer_in_json, listen, read_json_body
from vlrft.rewards.wire import CheckedImage, WireError, decode_images
from vlrft.types import Prompt, Rollout

NAME = "teacher server"  # how its log lines start


class Teacher:
    """The frozen teacher and what it reads requests with: its tokenizer's modality ids, its
    image processor, its image-token check."""

    def __init__(self, options: TeacherOptions):
        problem = precision_config_problem(options.attention, options.compute_dtype, zero_stage=0)
        if problem:  # (its words name the trainer's keys; here they are this server's flags)
            raise ConfigError("teacher server: " + problem.replace("config key 'model.attention'", "--attention")
                              .replace("config key 'model.compute_dtype'", "--compute-dtype")
                              .replace("model.compute_dtype", "--compute-dtype"))
        self.options = options
        model = local_model_dir(options.model, "--model")  # a directory, or a hub id's snapshot
        self.model = load_teacher(model, resolve_attention(options.attention, options.compute_dtype), options.compute_dtype)
        self.encoder = PromptEncoder(model, 1, 1, options.max_tokens)  # pixel bounds: each request's own
        self.vision = hasattr(self.model.config, "vision_config")
        if self.vision:  # the wire carries images, never videos: the tower is called for images only
            declare_modalities(self.model.model, {"image"})
        self.image_check = ImageTokenCheck.for_model(self.model.config)
        self.vocab_size = min(self.model.get_input_embeddings().num_embeddings,
                              self.model.get_output_embeddings().out_features)
        self.vocab_sha256 = vocab_digest(self.encoder.tokenizer.get_vocab())
        self.forward_lock = threading.Lock()  # one forward at a time: memory for one micro-batch

    def health(self) -> dict:
        limits = self.options.listen.limits
        return {"status": "ok", "vocab_sha256": self.vocab_sha256, "vocab_size": self.vocab_size, "vision": self.vision,
                "max_items": limits.max_items, "max_tokens": self.options.max_tokens,
                "max_sequence_tokens": self.options.micro_batch_tokens,
                "max_body_bytes": limits.max_body_bytes, "max_request_pixels": limits.max_request_pixels}

    def rollouts(self, request: LogprobsRequest) -> list[Rollout]:
        """The request's samples as the trainer holds them (Rejected 422 for images that do not
        fit their prompt's image tokens)."""
        encoder = copy.copy(self.encoder)  # its processing, with the request's pixel bounds
        encoder.min_pixels, encoder.max_pixels = request.min_pixels, request.max_pixels
        prompts = []
        for k, part in enumerate(request.prompts):
            images, mm_inputs = self._pixels(encoder, part.ids, part.images, f"prompt {k}")
            types = encoder.token_types(part.ids) if self.vision else []
            prompts.append(Prompt(id=f"prompt {k}", data_source="", answer="", meta={}, prompt_text="",
                                  prompt_ids=part.ids, images=images, mm_inputs=mm_inputs, mm_token_types=types, index=k))
        rollouts = []
        for i, sample in enumerate(request.samples):
            images, mm_inputs = self._pixels(encoder, sample.response_ids, sample.observation_images, f"sample {i} observation")
            rollout = Rollout(prompts[sample.prompt], sample.prompt, sample.response_ids, "", False,
                              observation_images=images, observation_mm_inputs=mm_inputs,
                              response_mm_token_types=encoder.token_types(sample.response_ids) if images else [])
            pad = self.image_check.image_token_id if self.image_check is not None else None
            whole = pad_runs(prompts[sample.prompt].prompt_ids + sample.response_ids, pad)
            if images and pad is not None and len(whole) != len(pad_runs(prompts[sample.prompt].prompt_ids, pad)) + len(images):
                raise Rejected(422, f"sample {i}: its first image tokens continue its prompt's last image's run")
            problem = self.image_check.problem(rollout) if self.image_check is not None else None
            if problem:
                raise Rejected(422, f"sample {i}: {problem}")
            rollouts.append(rollout)
        return rollouts

    def _pixels(self, encoder: PromptEncoder, ids: list[int], images: list[CheckedImage], name: str) -> tuple[list, dict]:
        """The images decoded and their pixel inputs, once their sizes give as many image tokens
        as `ids` hold (counted before any is decoded, where the processor can count them)."""
        found = ids.count(self.image_check.image_token_id) if self.image_check is not None else 0
        if not images and not found:
            return [], {}
        if images and encoder.image_processor is None:
            raise Rejected(422, f"{name} has images, and this teacher reads none (no vision tower or image processor)")
        try:
            counts = [encoder.image_tokens(image.width, image.height) for image in images]
        except ValueError as err:  # a size the processor refuses (aspect ratio)
            raise Rejected(422, f"{name}: cannot use its images ({err})") from None
        expected = sum(counts)
        if found != expected and (expected or not images):  # (0 from images: the processor cannot count)
            raise Rejected(422, f"{name} has {found} image tokens but its images give {expected} "
                                "(min_pixels, max_pixels as the trainer's data.min_pixels, data.max_pixels?)")
        runs = pad_runs(ids, self.image_check.image_token_id) if self.image_check is not None else counts
        if len(runs) != len(counts) or (expected and runs != counts):  # (else the model's rope index raises)
            raise Rejected(422, f"{name}: its image tokens form runs of {runs[:20]} tokens, and its images give "
                                f"{counts[:20]}: each image's tokens must be one run, in the images' order")
        try:
            decoded = decode_images(images, name)
            return decoded, encoder.image_inputs(decoded, name)
        except (WireError, DataError) as err:
            raise Rejected(422, str(err)) from None

    def score(self, rollouts: list[Rollout], temperature: float) -> tuple[list[list[float]], list[list[int]]]:
        """Per rollout, each response token's logprob and whether it is the teacher's argmax."""
        batches = [pack(group, share=True)
                   for group in split_by_token_budget(rollouts, self.options.micro_batch_tokens, share=True)]
        rows: dict[int, tuple[list[float], list[int]]] = {}  # id(rollout) -> its rows (packing reorders)
        for batch in batches:
            with self.forward_lock:
                scores = teacher_scores(self.model, batch, temperature)
            for rollout, lp, hit in zip(batch.samples, gather_responses(batch, scores.logp, "cpu"),
                                        gather_responses(batch, scores.argmax, "cpu")):
                rows[id(rollout)] = (lp.tolist(), [int(h) for h in hit.tolist()])
        return [rows[id(r)][0] for r in rollouts], [rows[id(r)][1] for r in rollouts]


def make_teacher_app(teacher: Teacher) -> Flask:
    """The Flask app; the header checks (token, Host, Origin, Content-Type) ran before it, in
    vlrft.rewards.server_http."""
    app = Flask("vlrft-teacher-server")
    limits, options = teacher.options.listen.limits, teacher.options

    @app.get("/health")
    def health():
        return jsonify(teacher.health())

    @app.post("/logprobs")
    def logprobs():
        request = check_logprobs_request(read_json_body(limits), limits, options.max_tokens, options.micro_batch_tokens,
                                         teacher.vocab_size)
        scored, top = teacher.score(teacher.rollouts(request), request.temperature)
        return jsonify(logprobs=scored, argmax=top)

    answer_in_json(app, NAME)
    return app


def teacher_server(teacher: Teacher):
    """The loaded teacher's server, listening (`run()` serves until `close()`)."""
    return listen(make_teacher_app(teacher), teacher.options.listen, NAME)


def serve_teacher(options: TeacherOptions) -> None:
    check_bind(options.listen.host, options.listen.token, NAME, TOKEN_ENV)  # before the model loads
    server = teacher_server(Teacher(options))
    auth = "token required" if options.listen.token else "no token"
    print(f"vlrft teacher server: {options.model} on http://{options.listen.host}:{options.listen.port} "
          f"({options.compute_dtype}, {options.listen.threads} threads, {auth})", flush=True)
    server.run()


def pad_runs(ids: list[int], pad: int | None) -> list[int]:
    """The lengths of the runs of `pad` in `ids`, in order."""
    runs, previous = [], None
    for token in ids:
        if token == pad:
            if previous == pad:
                runs[-1] += 1
            else:
                runs.append(1)
        previous = token
    return runs
