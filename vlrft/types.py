"""The few data types the loop passes around."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Prompt:
    """One encoded dataset row, ready for an engine and for the trainer's forward."""

    id: str
    data_source: str
    answer: str
    meta: dict
    prompt_text: str  # chat-templated text, with one <|image_pad|> per image (engines' input)
    prompt_ids: list[int]  # token ids with image pads expanded to the image's token count
    images: list = field(default_factory=list)  # PIL images after resizing
    mm_inputs: dict[str, torch.Tensor] = field(default_factory=dict)  # pixel_values, image_grid_thw; videos' too
    # Per prompt token: 0 text, 1 image, 2 video (Qwen-VL's mm_token_type_ids). Empty for text-only
    # models. The model computes 3-D M-RoPE positions only when it receives these.
    mm_token_types: list[int] = field(default_factory=list)
    index: int = -1  # position in the run's prompt stream (unique); the group id of its responses
    messages: list = field(default_factory=list)  # the row's chat messages (reward models re-template them)
    # The prompt's M-RoPE position ids ([3, 1, P]) by rope-index function, filled on first use
    # (models/packing.position_ids): every response to the prompt shares them.
    rope_positions: dict = field(default_factory=dict, init=False, repr=False, compare=False)


@dataclass
class Rollout:
    """One sampled response to a prompt."""

    prompt: Prompt
    group_id: int  # explicit group: all responses of one prompt share it
    response_ids: list[int]  # includes the stop token when the response finished
    response_text: str  # decoded without special tokens
    truncated: bool  # no stop token within max_new_tokens
    # [R] the engine's own logprob of each sampled token (vLLM; None for engines that do not
    # report them). Compared with the trainer's in `rollout/engine_logprob_diff_*`.
    logprobs: list[float] | None = None
    # Multi-turn rollouts (vlrft/multiturn): per response token, 1 where the policy generated it
    # and 0 on the environment's observation tokens, which stay in the sequence (the model reads
    # them) but are out of every loss, advantage and rollout metric. None: all generated.
    trained: list[int] | None = None
    turns: list[dict] = field(default_factory=list)  # multi-turn: one {"action", "observation", "reward"} per turn
    # Multi-turn: the images the environment showed (PIL, in order), their pixel inputs, and the
    # response's per-token modality ids (as Prompt.mm_token_types); empty when none was shown.
    observation_images: list = field(default_factory=list)
    observation_mm_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    response_mm_token_types: list[int] = field(default_factory=list)
    # M-RoPE ids of the whole sequence when observations hold images ([3, 1, P + R]), filled on
    # first use (models/packing.position_ids)
    rope_positions: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def mm_inputs(self) -> dict[str, torch.Tensor]:
        """The pixel inputs of the whole sequence: the prompt's, then the observations'."""
        if not self.observation_mm_inputs:
            return self.prompt.mm_inputs
        parts = (self.prompt.mm_inputs, self.observation_mm_inputs)
        keys = sorted({k for part in parts for k in part})
        return {k: torch.cat([part[k] for part in parts if k in part]) for k in keys}

    def mm_token_types(self) -> list[int]:
        """Per token of prompt + response: 0 text, 1 image, 2 video; [] for text-only models."""
        if not self.prompt.mm_token_types and not self.response_mm_token_types:
            return []
        prompt = self.prompt.mm_token_types or [0] * len(self.prompt.prompt_ids)
        return prompt + (self.response_mm_token_types or [0] * len(self.response_ids))

    def trained_mask(self) -> torch.Tensor:
        """[R] float: 1 on the tokens the policy generated (the ones that are trained)."""
        if self.trained is None:
            return torch.ones(len(self.response_ids))
        return torch.tensor(self.trained, dtype=torch.float32)


@dataclass
class Experience:
    """A scored rollout with everything the policy update needs; per-token tensors are [R].

    Filled in two stages: scoring (reward fields) and the experience pass (the rest).
    """

    rollout: Rollout
    reward: float  # weighted scalar reward, as the recipes scored it
    reward_components: dict[str, Any]
    dense_reward: list[float] | None = None  # [R] weighted per-token recipe rewards
    old_logprobs: torch.Tensor | None = None  # [R] rollout-time policy logprob of each response token
    ref_logprobs: torch.Tensor | None = None  # [R] reference logprobs (None when KL is off)
    teacher_logprobs: torch.Tensor | None = None  # [R] on-policy distillation's teacher's logprobs (None: no teacher)
    teacher_topk_ids: torch.Tensor | None = None  # [R, k] int32 the teacher's k most likely tokens (algo.distill.mode jsd)
    teacher_topk_logprobs: torch.Tensor | None = None  # [R, k] their teacher logprobs
    advantages: torch.Tensor | None = None  # [R]
    values: torch.Tensor | None = None  # [R] rollout-time critic outputs (normalised space if value_norm)
    returns: torch.Tensor | None = None  # [R] critic targets (same space as values)
    entropy: torch.Tensor | None = None  # [R] rollout-time policy entropy at each response token
    correction: torch.Tensor | None = None  # [R] rollout-correction weight of each token's pg term (None = off)
    in_loss: bool = True  # False: kept for bookkeeping only (mask_truncated, placeholders)
    correct: float = 0.0  # the accuracy recipe's verdict (set by mark_correct before metrics)

    @property
    def total_reward(self) -> float:
        """The scalar reward plus the sum of any dense (per-token) reward: what filters rank by."""
        return self.reward + sum(self.dense_reward or [])


@dataclass
class Segment:
    """A run of consecutive tokens in a packed micro-batch: a sample's prompt and response, its
    prompt alone (shared by the responses after it), or its response alone, continuing the
    prompt segment `parent` (models/packing.pack)."""

    sample: Any  # the Experience (or Rollout) whose tokens these are; for a shared prompt, its group's first
    prompt: bool  # holds the prompt's tokens
    response: bool  # holds the response's tokens
    parent: int = -1  # a response-only segment: the index of the prompt segment it continues


@dataclass
class MicroBatch:
    """Sequences for one forward pass: right-padded rows ([B, L]) or packed into one row
    ([1, T], `segments` and `seq_lengths` set; how segments are kept apart is up to the
    attention kernel, see models/packing.forward_inputs)."""

    input_ids: torch.Tensor  # [B, L] or [1, T]
    attention_mask: torch.Tensor | None  # [B, L] padding mask; None when packed
    response_mask: torch.Tensor  # [B, L] 1 on response tokens (scored positions)
    mm_inputs: dict[str, torch.Tensor]  # pixel inputs concatenated in row order (a shared prompt's once); mm_token_type_ids [B, L]
    samples: list[Any]  # the Experience (or Rollout) objects, in order
    dummy: bool = False  # a repeat that only keeps ranks in lock-step; contributes nothing
    seq_lengths: list[int] | None = None  # packed: each segment's length, in order
    segments: list[Segment] | None = None  # packed: the token runs of the row, in order
    owned: bool = True  # this rank's samples (sequence parallelism: False for a peer's, run here too)

    def shares_prompts(self) -> bool:
        """Whether some response continues a prompt segment it shares with its siblings."""
        return any(segment.parent >= 0 for segment in self.segments or ())

    def model_inputs(self) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask, **self.mm_inputs}
