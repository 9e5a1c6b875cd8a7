"""Experiences from responses generated and scored outside vlrft (`SPMDTrainer.step`, the
Python API in the style of TRL's `PPOTrainer.step(queries, responses, scores)`)."""

from __future__ import annotations

import time
from typing import Sequence

import torch

from vlrft.data.dataset import DataError, canonical_row, modalities_of
from vlrft.distributed import all_gather_1d
from vlrft.models.collate import gather_responses
from vlrft.models.forward import token_logprobs
from vlrft.models.packing import micro_batches
from vlrft.models.sequence_parallel import combine
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


def train_on_responses(trainer, prompts: list[dict], responses: list[list], scores: list[list[float]]) -> dict[str, float]:
    """One RL step on responses generated and scored elsewhere (TRL's `PPOTrainer.step`):
    this rank's `prompts` (rows as in a data file), per prompt a group of `responses`
    (text, or token ids) and their `scores` (the rewards). The same experience pass,
    advantages, update and engine sync as `train_step`. A collective: every rank calls it.
    Returns the step's metrics."""
    check_shapes(len(prompts), responses, scores)
    start = time.perf_counter()
    counts = all_gather_1d(torch.tensor([len(prompts)])).tolist()
    first = sum(counts[: trainer.rank])  # group ids unique over all ranks
    items, problems = [], []  # a bad row must stop (or be skipped on) every rank, not hang the others
    for i, row in enumerate(prompts):
        try:
            items.append((canonical_row(row, i, trainer.bad_input.columns, trainer.bad_input.media), first + i))
        except DataError as err:
            problems.append(str(err))
    trainer.declare_vision_modalities(modalities_of([row for row, _ in items]))
    encoded, skipped = trainer.bad_input.encode(trainer.encoder, items, problems)
    kept = [p.index - first for p in encoded]  # with data.on_bad_sample: skip, bad prompts are left out
    scored = scored_experiences(
        encoded, [responses[i] for i in kept], [scores[i] for i in kept], trainer.encoder.tokenizer, trainer.stop_ids
    )
    trainer.begin_step()  # only now: a step stopped by bad input does not count
    return trainer.learn(scored, scored, {"data/skipped_prompts": float(skipped)}, start)

@torch.no_grad()
def response_logprobs(trainer, prompts: list[dict], responses: list[list]) -> list[list[float]]:
    """Each response's logprob (the sum over its tokens, at the sampling temperature) under
    the current policy, for `step`'s prompts and responses. A collective: every rank calls it."""
    check_shapes(len(prompts), responses, responses)
    bad_input = trainer.bad_input
    rows = [canonical_row(row, i, bad_input.columns, bad_input.media) for i, row in enumerate(prompts)]
    trainer.declare_vision_modalities(modalities_of(rows))
    encoded = [trainer.encoder.encode(row, i) for i, row in enumerate(rows)]
    scored = scored_experiences(encoded, responses, [[0.0] * len(r) for r in responses], trainer.encoder.tokenizer, trainer.stop_ids)
    rollouts = [e.rollout for e in scored]
    placeholder = trainer.bad_input.placeholder(trainer.encoder, trainer.train_rows).rollout
    sums: dict[int, float] = {}
    for batch in micro_batches(rollouts, trainer.cfg.train.micro_batch_tokens, placeholder, share=trainer.cfg.train.share_prompts):
        logp = combine(token_logprobs(trainer.backend.model, batch, trainer.cfg.rollout.temperature))
        if not batch.dummy and batch.owned:
            for rollout, row in zip(batch.samples, gather_responses(batch, logp, "cpu")):
                sums[id(rollout)] = float(row.sum())
    flat = iter(sums[id(r)] for r in rollouts)
    return [[next(flat) for _ in group] for group in responses]
