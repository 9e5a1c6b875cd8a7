"""Experiences from responses generated and scored outside vlrft (`SPMDTrainer.step`, the
Python API in the style of TRL's `PPOTrainer.step(queries, responses, scores)`)."""

from __future__ import annotations

from typing import Sequence

from vlrft.types import Experience, Prompt, Rollout

END_OF_TURN = "<|im_end|>"  # what a Qwen chat model emits to end its answer


def end_of_turn_id(tokenizer) -> int:
    """The token a finished text response ends with: the chat template's end of turn, else EOS."""
    vocab = tokenizer.get_vocab()
    token = vocab.get(END_OF_TURN, tokenizer.eos_token_id)
    if token is None:
        raise ValueError("the tokenizer has neither <|im_end|> nor an EOS token to end responses with")
    return token


def check_shapes(n_prompts: int, responses: Sequence, scores: Sequence) -> None:
    """One line naming the first prompt whose responses and scores do not pair up."""
    if len(responses) != n_prompts or len(scores) != n_prompts:
        raise ValueError(
            f"step: {n_prompts} prompts need as many response lists and score lists, got {len(responses)} and {len(scores)}"
        )
    for i, (texts, values) in enumerate(zip(responses, scores)):
        if isinstance(texts, str) or not len(texts):
            raise ValueError(f"step: prompt {i}: responses must be a non-empty list (a group) of strings or token-id lists")
        if len(values) != len(texts):
            raise ValueError(f"step: prompt {i} has {len(texts)} responses and {len(values)} scores")


def scored_experiences(
    prompts: list[Prompt], responses: Sequence, scores: Sequence, tokenizer, stop_ids: list[int]
) -> list[Experience]:
    """One Experience per response. A response is text (tokenized without special tokens and
    ended with the end-of-turn token: it finished) or token ids, used as they are (truncated
    when they do not end in a stop token). Its score is its reward; the group is its prompt's."""
    end = end_of_turn_id(tokenizer)
    experiences = []
    for prompt, texts, values in zip(prompts, responses, scores):
        for response, score in zip(texts, values):
            if isinstance(response, str):
                ids = tokenizer(response, add_special_tokens=False).input_ids + [end]
            else:
                ids = [int(t) for t in response]
            truncated = not ids or ids[-1] not in stop_ids
            text = tokenizer.decode(ids, skip_special_tokens=True)
            rollout = Rollout(prompt=prompt, group_id=prompt.index, response_ids=ids, response_text=text, truncated=truncated)
            experiences.append(Experience(rollout, float(score), {"score": float(score)}))
    return experiences
