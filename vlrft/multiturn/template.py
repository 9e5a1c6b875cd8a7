"""The tokens that wrap an environment's observation between two policy turns, read once from
the chat template.

A multi-turn sequence is never re-rendered or re-tokenized: each turn appends the engine's own
token ids, then this template's tokens for the observation. Re-rendering a conversation is how
peers drift (a template that rewrites earlier turns, a BPE merge across a turn boundary): the
tokens the policy was scored on would not be the tokens it sampled. The template is probed with
a marker conversation; one that rewrites what came before a new turn (not append-only, e.g. it
drops earlier turns' reasoning) is refused with one line.
"""

from __future__ import annotations

from dataclasses import dataclass

from vlrft.data.encoding import IMAGE_PAD
from vlrft.errors import ConfigError

_QUESTION = "vlrft-question"
_ACTION = "<think>\nvlrft-thought\n</think>\n\nvlrft-action"
_OBSERVATION = "vlrft-observation"


@dataclass
class ObservationTemplate:
    tokenizer: object
    glue: dict[int, str]  # stop token id -> the text the template puts between it and an observation
    suffix: str  # after the observation, up to and including the next assistant turn's header
    special_tokens: list[str]  # the tokenizer's special tokens (<|im_end|>, <|image_pad|>, ...)
    # How the template writes one image part of an observation turn, with one <|image_pad|>
    # (Qwen-VL: <|vision_start|><|image_pad|><|vision_end|>); None: it writes none.
    image_part: str | None = None

    def observation_ids(self, stop_id: int, text: str, images: str = "") -> list[int] | None:
        """Token ids that follow a turn ending in `stop_id`: the observation wrapped as the
        template wraps it, ending where the next assistant turn starts; `images` (image parts,
        pads expanded) come before the text, as an image-first message renders. None when the
        turn ended in a stop token that is not the template's end of turn (the policy ended
        the conversation). Special-token text inside an observation stays text: an environment
        (or a tool echoing its input) cannot end a turn or inject an image placeholder."""
        if stop_id not in self.glue:
            return None
        encode = self.tokenizer.encode
        if not any(special in text for special in self.special_tokens):
            return encode(self.glue[stop_id] + images + text + self.suffix, add_special_tokens=False)
        return (encode(self.glue[stop_id] + images, add_special_tokens=False)
                + encode(text, add_special_tokens=False, split_special_tokens=True)
                + encode(self.suffix, add_special_tokens=False))


def render(tokenizer, messages: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def observation_template(tokenizer, stop_ids: list[int], role: str, model: str) -> ObservationTemplate:
    """Probe the chat template for how a `role` turn ("tool" or "user") follows an assistant
    turn. ConfigError (one line) when the template is not append-only there."""
    question = [{"role": "user", "content": _QUESTION}]
    acted = render(tokenizer, question + [{"role": "assistant", "content": _ACTION}], False)
    answered = render(tokenizer, question + [{"role": "assistant", "content": _ACTION}, {"role": role, "content": _OBSERVATION}], True)
    end = acted.rfind("vlrft-action") + len("vlrft-action")
    if end < len("vlrft-action") or answered[:end] != acted[:end]:
        raise ConfigError(
            f"the chat template of {model} is not append-only: adding a '{role}' turn rewrites the assistant turn before "
            "it (e.g. drops its reasoning); multi-turn rollouts need a template that only appends"
        )
    between, found, suffix = answered[end:].partition(_OBSERVATION)
    if not found:
        raise ConfigError(f"the chat template of {model} does not render a '{role}' turn's content")
    glue = {}
    for stop in stop_ids:
        stop_text = tokenizer.decode([stop])
        if stop_text and between.startswith(stop_text) and acted[end:].startswith(stop_text):
            glue[stop] = between[len(stop_text) :]
    if not glue:
        raise ConfigError(f"the chat template of {model} does not end an assistant turn with a stop token ({between[:40]!r})")
    specials = [token.content for token in tokenizer.added_tokens_decoder.values() if token.special]
    return ObservationTemplate(tokenizer, glue, suffix, specials, image_part(tokenizer, question, role, between, suffix))


def image_part(tokenizer, question: list[dict], role: str, between: str, suffix: str) -> str | None:
    """The text an image-first `role` turn adds before its text, when it is one image
    placeholder (rendered with the same glue and suffix as a text turn); None otherwise."""
    with_image = [{"type": "image"}, {"type": "text", "text": _OBSERVATION}]
    try:
        answered = render(tokenizer, question + [{"role": "assistant", "content": _ACTION}, {"role": role, "content": with_image}], True)
    except Exception:  # noqa: BLE001 - a text-only template may reject list content in any way
        return None
    start = answered.rfind("vlrft-action") + len("vlrft-action")
    before, found, after = answered[start:].partition(_OBSERVATION)
    if not found or after != suffix or not before.startswith(between) or before.count(IMAGE_PAD) != 1:
        return None
    return before[len(between) :]
