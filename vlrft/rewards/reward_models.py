"""Model-based reward recipes: a scalar reward model and a generative judge.

Both load their checkpoint once per path (local `from_pretrained`, never a hub), cache it for
the process, and hold a per-checkpoint lock while loading and while scoring: the caller runs
each recipe call in a worker thread, and HF tokenizers and models are not safe to share
between threads mid-call. (A call abandoned by the caller's timeout keeps its lock until it
finishes, so the next call on the same checkpoint waits for it.)

Both run in the trainer's process (`runs_in_trainer`, rewards/guard.py), not in a worker
process: a worker would hold a second copy of the model and a second CUDA context on the GPU
the trainer uses.
"""

from __future__ import annotations

import re
import string
import sys
import threading

import torch
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from vlrft.data.dataset import message_text, user_text
from vlrft.distributed import device

_LOAD_LOCK = threading.Lock()  # guards the caches below (not the models)
_RM_CACHE: dict[str, tuple] = {}  # path -> (tokenizer, model, lock)
_JUDGE_CACHE: dict[str, dict] = {}  # path -> {"engine", "lock", "encoders": {(min, max): PromptEncoder}}

JUDGE_FIELDS = ("prompt", "completion", "answer")


# --------------------------------------------------------------------------- scalar reward model


def _load_reward_model(path: str) -> tuple:
    with _LOAD_LOCK:
        if path not in _RM_CACHE:
            num_labels = AutoConfig.from_pretrained(path).num_labels
            if num_labels != 1:
                raise ValueError(f"reward model {path} has num_labels={num_labels}; a scalar reward model needs 1")
            tokenizer = AutoTokenizer.from_pretrained(path)
            tokenizer.padding_side = "right"
            tokenizer.truncation_side = "left"  # keep the end: the classifier reads the last token
            if tokenizer.pad_token is None:
                tokenizer.pad_token = tokenizer.eos_token
            # On the rank's device, beside the policy (the engine-side judge is an HFEngine, also there).
            model = AutoModelForSequenceClassification.from_pretrained(path).eval().requires_grad_(False).to(device())
            if model.config.pad_token_id is None:  # it locates each row's last non-pad token
                model.config.pad_token_id = tokenizer.pad_token_id
            _RM_CACHE[path] = (tokenizer, model, threading.Lock())
        return _RM_CACHE[path]


def reward_model_text(tokenizer, completion: str, sample: dict) -> str:
    """The text a scalar reward model scores: the tokenizer's chat template over the sample's
    messages (image parts dropped, text parts joined by newlines: the reward model is
    text-only) plus an assistant turn holding the completion; without a chat template,
    `prompt + "\\n" + completion`."""
    if not getattr(tokenizer, "chat_template", None):
        return sample["prompt"] + "\n" + completion
    messages = [{"role": m["role"], "content": message_text(m["content"])} for m in sample["messages"]]
    messages.append({"role": "assistant", "content": completion})
    return tokenizer.apply_chat_template(messages, tokenize=False)


@torch.no_grad()
def scalar_reward_model(
    completions: list[str], samples: list[dict], path: str, batch_size: int = 8, max_length: int = 1024
) -> list[float]:
    """Score = logits[:, 0] of a num_labels=1 sequence-classification checkpoint at `path` on
    `reward_model_text(...)`, tokenized in batches of `batch_size` with right padding and
    truncated FROM THE LEFT to `max_length` tokens (the final tokens, which the classifier
    reads, are always kept). The model pools each row's last non-pad token (its
    `config.pad_token_id`, set from the tokenizer when missing). ValueError if num_labels != 1."""
    tokenizer, model, lock = _load_reward_model(path)
    texts = [reward_model_text(tokenizer, c, s) for c, s in zip(completions, samples)]
    # A chat template already writes its special tokens; only the plain fallback adds them.
    special = not getattr(tokenizer, "chat_template", None)
    scores: list[float] = []
    with lock:
        for start in range(0, len(texts), batch_size):
            batch = tokenizer(
                texts[start : start + batch_size],
                padding=True,
                truncation=True,
                max_length=max_length,
                add_special_tokens=special,
                return_tensors="pt",
            )
            inputs = {k: batch[k].to(model.device) for k in ("input_ids", "attention_mask")}
            logits = model(**inputs).logits  # [B, 1]
            scores += [float(x) for x in logits[:, 0].float()]
    return scores


scalar_reward_model.runs_in_trainer = True  # the model stays on the trainer's GPU (module docstring)


# --------------------------------------------------------------------------- generative judge


def check_judge_template(template: str) -> None:
    """ValueError naming the first replacement field that is not {prompt}, {completion} or {answer}."""
    for _, field, _, _ in string.Formatter().parse(template):
        if field is None:
            continue
        name = re.split(r"[.\[]", field, maxsplit=1)[0]
        if name not in JUDGE_FIELDS:
            allowed = ", ".join("{" + f + "}" for f in JUDGE_FIELDS)
            raise ValueError(f"judge template field {{{field}}} is unknown; allowed: {allowed}")


def parse_score(text: str, pattern: str, scale: float = 1.0) -> float | None:
    """scale * float(group 1 of the first match of `pattern` in `text`) (group 0 when the
    pattern has no group); None when nothing matches or the match is not a number."""
    match = re.search(pattern, text)
    if match is None:
        return None
    try:
        return scale * float(match.group(1) if match.re.groups else match.group(0))
    except (TypeError, ValueError):  # an optional group that did not take part / not a number
        return None


def _load_judge(path: str, min_pixels: int, max_pixels: int):
    from vlrft.data.encoding import PromptEncoder
    from vlrft.engines.hf_engine import HFEngine
    from vlrft.models.loader import banned_token_ids, stop_token_ids

    with _LOAD_LOCK:
        entry = _JUDGE_CACHE.get(path)
        if entry is None:
            # No prompt-length cap of its own: the judge's context length is the limit.
            encoder = PromptEncoder(path, min_pixels, max_pixels, max_prompt_tokens=sys.maxsize)
            tok = encoder.tokenizer
            # Dynamic decoding: a judge is called from worker threads (CUDA graphs are captured
            # per thread) with batches of any size (each would compile a step of its own).
            engine = HFEngine(path, tok, stop_token_ids(tok), banned_token_ids(tok), max_batch=sys.maxsize, decode="dynamic")
            entry = _JUDGE_CACHE[path] = {"engine": engine, "lock": threading.Lock(), "encoders": {(min_pixels, max_pixels): encoder}}
        if (min_pixels, max_pixels) not in entry["encoders"]:
            entry["encoders"][(min_pixels, max_pixels)] = PromptEncoder(path, min_pixels, max_pixels, sys.maxsize)
        return entry["engine"], entry["encoders"][(min_pixels, max_pixels)], entry["lock"]


def judge_row(template: str, completion: str, sample: dict, with_images: bool) -> tuple[dict, list]:
    """The judge's row and images: one user message holding the sample's images as image parts
    (only when `with_images`, i.e. the judge has an image processor; a text judge never sees
    them) followed by `template.format(prompt=sample["prompt"], completion=..., answer=...)`."""
    prompt = sample.get("prompt")
    if prompt is None:
        prompt = user_text(sample.get("messages", []))
    text = template.format(prompt=prompt, completion=completion, answer=sample.get("answer", ""))
    images = list(sample.get("images") or []) if with_images else []
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    row = {
        "id": sample.get("id", ""),
        "messages": [{"role": "user", "content": content}],
        "answer": sample.get("answer", ""),
        "data_source": sample.get("data_source", ""),
        "meta": sample.get("meta", {}),
    }
    return row, images


def generative_judge(
    completions: list[str],
    samples: list[dict],
    path: str,
    template: str,
    score_pattern: str = r"(-?\d+(?:\.\d+)?)",
    scale: float = 1.0,
    max_new_tokens: int = 16,
    batch_size: int = 8,
    min_pixels: int = 3136,
    max_pixels: int = 12544,
) -> list[float | None]:
    """A causal-LM or VL judge at `path` reads `judge_row(...)` (chat-templated exactly as the
    trainer encodes prompts, images resized to [min_pixels, max_pixels]), decodes greedily up
    to `max_new_tokens`, and the score is `parse_score(output, score_pattern, scale)`: None
    (not applicable) when the output holds no number. ValueError for an unknown template field."""
    from vlrft.engines.base import SamplingParams

    check_judge_template(template)
    engine, encoder, lock = _load_judge(path, min_pixels, max_pixels)
    with_images = encoder.image_processor is not None
    params = SamplingParams(n=1, max_new_tokens=max_new_tokens, temperature=1.0, greedy=True)
    scores: list[float | None] = []
    with lock:
        prompts = []
        for i, (completion, sample) in enumerate(zip(completions, samples)):
            row, images = judge_row(template, completion, sample, with_images)
            prompts.append(encoder.encode_with_images(row, images, i))
        for start in range(0, len(prompts), batch_size):
            rollouts = engine.generate(prompts[start : start + batch_size], params)
            scores += [parse_score(r.response_text, score_pattern, scale) for r in rollouts]
    return scores


generative_judge.runs_in_trainer = True  # the model stays on the trainer's GPU (module docstring)
