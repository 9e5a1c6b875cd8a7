"""The remote teacher's wire format: what `vlrft teacher-server` takes at POST /logprobs and
answers, written by the trainer (`logprob_requests`) and read by the server
(`check_logprobs_request`) as any untrusted request: every field allowed by name, every id
an integer in the teacher's vocabulary, every size under a limit.

  {"temperature": number, "min_pixels": int, "max_pixels": int,
   "prompts": [{"ids": [int], "images": [{"png_base64": str}]}],
   "samples": [{"prompt": int, "response_ids": [int], "observation_images": [{"png_base64": str}]}]}
  -> {"logprobs": [[number]], "argmax": [[0 or 1]]}     per sample, per response token

A prompt is the student's token ids (each image's pads expanded) and the images the student's
processor was given, losslessly: the server's processor turns them into the same pixel inputs
with the same `min_pixels`/`max_pixels` (data.min_pixels, data.max_pixels). A multi-turn
response carries the images its observations showed (`observation_images`, optional). Each
prompt is sent once for all the responses to it in a request, and counted against the
token limit once per response: the server packs a prompt again into every micro-batch that holds
some of its responses, so a request's forward tokens are at most its samples' prompt and
response tokens summed, never the prompts once.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field

from vlrft.rewards.server_checks import Limits, Rejected
from vlrft.rewards.wire import MIN_IMAGE_PIXELS, CheckedImage, PixelLimitError, WireError, check_images, encode_image
from vlrft.types import Rollout

REQUEST_KEYS = {"temperature", "min_pixels", "max_pixels", "prompts", "samples"}
PROMPT_KEYS = {"ids", "images"}
SAMPLE_KEYS = {"prompt", "response_ids"}  # required; "observation_images" optional
BODY_SLACK = 256  # bytes of a body beyond its prompts and samples (keys, settings, brackets)


def vocab_digest(vocab: dict[str, int]) -> str:
    """A tokenizer vocabulary's fingerprint (sha256 of its sorted (token, id) pairs): equal for
    two tokenizers that read every id alike."""
    return hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()


@dataclass(frozen=True)
class RequestLimits:
    """What one request may hold, as the server's GET /health reports it."""

    max_items: int  # samples
    max_tokens: int  # each sample's prompt and response tokens, summed over the samples
    max_body_bytes: int
    max_request_pixels: int  # each image at least MIN_IMAGE_PIXELS


# ---- the trainer's side -------------------------------------------------------------------


Cost = tuple[int, int, int, int]  # items, tokens, pixels, bytes: what RequestLimits bound


@dataclass
class _Request:
    prompts: list[str] = field(default_factory=list)  # JSON of each prompt
    slots: dict[str, int] = field(default_factory=dict)  # a prompt's JSON -> its index in `prompts`
    samples: list[dict] = field(default_factory=list)
    rollouts: list[int] = field(default_factory=list)  # the index of each sample's rollout
    cost: Cost = (0, 0, 0, BODY_SLACK)

    def cost_with(self, prompt: str, prompt_cost: Cost, sample_cost: Cost) -> Cost:
        return _sum(_sum(self.cost, sample_cost), (0, 0, 0, 0) if prompt in self.slots else prompt_cost)

    def add(self, prompt: str, sample: dict, rollout: int, cost: Cost) -> None:
        if prompt not in self.slots:
            self.slots[prompt] = len(self.prompts)
            self.prompts.append(prompt)
        self.samples.append({"prompt": self.slots[prompt], **sample})
        self.rollouts.append(rollout)
        self.cost = cost

    def body(self, settings: str) -> bytes:
        return (settings[:-1] + ', "prompts": [' + ", ".join(self.prompts) + '], "samples": '
                + json.dumps(self.samples) + "}").encode()


def logprob_requests(rollouts: list[Rollout], temperature: float, min_pixels: int, max_pixels: int,
                     limits: RequestLimits) -> list[tuple[bytes, list[int]]]:
    """The bodies that score `rollouts`' responses (empty ones left out), each with the
    indices of the rollouts it holds, in its order: rollouts of one prompt together, as many
    in a request as its limits allow (a sample too large alone goes alone: the server names
    the limit)."""
    encoded: dict[int, tuple[str, Cost]] = {}  # id(prompt) -> its JSON and cost
    caps = (limits.max_items, limits.max_tokens, limits.max_request_pixels, limits.max_body_bytes)
    order = sorted((i for i, r in enumerate(rollouts) if r.response_ids), key=_first_of_prompt(rollouts))
    requests = [_Request()]
    for i in order:
        rollout = rollouts[i]
        if id(rollout.prompt) not in encoded:
            encoded[id(rollout.prompt)] = _encoded_prompt(rollout)
        prompt, prompt_cost = encoded[id(rollout.prompt)]
        sample = {"response_ids": list(rollout.response_ids)}
        if rollout.observation_images:
            sample["observation_images"] = [encode_image(image) for image in rollout.observation_images]
        sample_cost = (1, len(rollout.prompt.prompt_ids) + len(rollout.response_ids), _pixels(rollout.observation_images),
                       len(json.dumps(sample)) + 16)
        cost = requests[-1].cost_with(prompt, prompt_cost, sample_cost)
        if requests[-1].samples and any(c > cap for c, cap in zip(cost, caps)):
            requests.append(_Request())
            cost = requests[-1].cost_with(prompt, prompt_cost, sample_cost)
        requests[-1].add(prompt, sample, i, cost)
    settings = json.dumps({"temperature": temperature, "min_pixels": min_pixels, "max_pixels": max_pixels})
    return [(r.body(settings), r.rollouts) for r in requests if r.samples]


def _first_of_prompt(rollouts: list[Rollout]):
    """Sort key: rollouts of one prompt together, prompts in order of first appearance."""
    first: dict[int, int] = {}
    for i, r in enumerate(rollouts):
        first.setdefault(id(r.prompt), i)
    return lambda i: (first[id(rollouts[i].prompt)], i)


def _encoded_prompt(rollout: Rollout) -> tuple[str, Cost]:
    prompt = rollout.prompt
    text = json.dumps({"ids": list(prompt.prompt_ids), "images": [encode_image(image) for image in prompt.images]})
    return text, (0, 0, _pixels(prompt.images), len(text) + 2)  # its tokens: counted with each sample


def _pixels(images: list) -> int:
    return sum(max(image.width * image.height, MIN_IMAGE_PIXELS) for image in images)


def _sum(a: Cost, b: Cost) -> Cost:
    return tuple(x + y for x, y in zip(a, b))


# ---- the server's side --------------------------------------------------------------------


@dataclass
class PromptPart:
    ids: list[int]
    images: list[CheckedImage]


@dataclass
class SamplePart:
    prompt: int  # index into the request's prompts
    response_ids: list[int]
    observation_images: list[CheckedImage]


@dataclass
class LogprobsRequest:
    temperature: float
    min_pixels: int
    max_pixels: int
    prompts: list[PromptPart]
    samples: list[SamplePart]


def check_logprobs_request(body, limits: Limits, max_tokens: int, max_sequence_tokens: int,
                           vocab_size: int) -> LogprobsRequest:
    """A parsed /logprobs body as a LogprobsRequest, or Rejected (422 naming the field, 413
    naming the flag of the limit it is over: `max_tokens` the samples' prompt and response
    tokens summed, `max_sequence_tokens` a prompt and its response). Images: headers read and
    checked, none decoded."""
    _fields(body, REQUEST_KEYS, set(), "body")
    temperature = body["temperature"]
    if not _is_number(temperature) or not 1e-3 <= temperature <= 1e3:
        raise Rejected(422, f"temperature must be a number in [0.001, 1000], got {str(temperature):.40}")
    min_pixels, max_pixels = body["min_pixels"], body["max_pixels"]
    if not (_is_int(min_pixels) and _is_int(max_pixels) and 1 <= min_pixels <= max_pixels <= limits.max_image_pixels):
        raise Rejected(422, f"min_pixels and max_pixels must be integers, 1 <= min_pixels <= max_pixels <= "
                            f"{limits.max_image_pixels} (--max-image-pixels)")
    prompts, samples = _list(body["prompts"], "prompts"), _list(body["samples"], "samples")
    if len(samples) > limits.max_items:
        raise Rejected(413, f"{len(samples)} samples are over the limit of {limits.max_items} (--max-items)")
    for k, prompt in enumerate(prompts):
        _fields(prompt, PROMPT_KEYS, set(), f"prompt {k}")
    for i, sample in enumerate(samples):
        _fields(sample, SAMPLE_KEYS, {"observation_images"}, f"sample {i}")
    where = [(prompt["ids"], f"prompt {k} ids") for k, prompt in enumerate(prompts)]
    where += [(sample["response_ids"], f"sample {i} response_ids") for i, sample in enumerate(samples)]
    tokens = sum(len(_list(ids, name)) for ids, name in where)
    if tokens > max_tokens:
        raise Rejected(413, f"the request holds {tokens} tokens, over the limit of {max_tokens} (--max-tokens)")
    for ids, name in where:
        _check_ids(ids, name, vocab_size, empty=name.endswith("response_ids"))
    used, forward = set(), 0
    for i, sample in enumerate(samples):
        if not _is_int(sample["prompt"]) or not 0 <= sample["prompt"] < len(prompts):
            raise Rejected(422, f"sample {i}: 'prompt' must be the index of one of the {len(prompts)} prompts")
        used.add(sample["prompt"])
        length = len(prompts[sample["prompt"]]["ids"]) + len(sample["response_ids"])
        if length > max_sequence_tokens:
            raise Rejected(413, f"sample {i}: its prompt and response hold {length} tokens, over the limit of "
                                f"{max_sequence_tokens} a sequence (--micro-batch-tokens)")
        forward += length
    if forward > max_tokens:  # what the packed forwards may hold: a prompt again in each micro-batch
        raise Rejected(413, f"the request's samples hold {forward} tokens with their prompts (each counted once a "
                            f"sample), over the limit of {max_tokens} (--max-tokens)")
    if len(used) < len(prompts):
        raise Rejected(422, f"prompt {min(set(range(len(prompts))) - used)} is the prompt of no sample")
    groups = [(f"prompt {k}", _list(p["images"], f"prompt {k} images")) for k, p in enumerate(prompts)]
    groups += [(f"sample {i} observation", _list(s.get("observation_images", []), f"sample {i} observation_images"))
               for i, s in enumerate(samples)]
    try:
        images = check_images(groups, limits.max_image_pixels, limits.max_request_pixels)
    except PixelLimitError as err:
        raise Rejected(413, str(err)) from None
    except WireError as err:
        raise Rejected(422, str(err)) from None
    count = sum(len(group) for group in images)  # each is resized to min_pixels at least: upscaling counts too
    if count * min_pixels > limits.max_request_pixels:
        raise Rejected(413, f"{count} images of min_pixels {min_pixels} each are over the limit of "
                            f"{limits.max_request_pixels} pixels (--max-request-pixels)")
    return LogprobsRequest(
        float(temperature), min_pixels, max_pixels,
        [PromptPart(p["ids"], images[k]) for k, p in enumerate(prompts)],
        [SamplePart(s["prompt"], s["response_ids"], images[len(prompts) + i]) for i, s in enumerate(samples)],
    )


def _fields(value, required: set[str], optional: set[str], where: str) -> None:
    if not isinstance(value, dict):
        raise Rejected(422, f"{where} must be a JSON object")
    missing, unknown = required - value.keys(), value.keys() - required - optional
    if missing:
        raise Rejected(422, f"{where} has no {sorted(missing)[0]!r}")
    if unknown:
        raise Rejected(422, f"{where} has an unknown field {str(sorted(unknown)[0])[:40]!r}")


def _list(value, where: str) -> list:
    if not isinstance(value, list):
        raise Rejected(422, f"{where} must be a list")
    return value


def _check_ids(ids: list, where: str, vocab_size: int, empty: bool) -> None:
    if not ids and not empty:
        raise Rejected(422, f"{where} is empty")
    for position, token in enumerate(ids):
        if not _is_int(token) or not 0 <= token < vocab_size:
            raise Rejected(422, f"{where}[{position}] is {str(token)[:40]}, not a token id in [0, {vocab_size})")


def _is_int(value) -> bool:
    return type(value) is int  # (not bool, a subclass of int)


def _is_number(value) -> bool:
    return type(value) in (int, float) and math.isfinite(value)
