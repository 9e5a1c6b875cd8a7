"""Multi-turn rollouts: the engine generates a turn, the environment answers, its observation is
appended as the chat template wraps it, until the environment is done, `max_turns` turns were
generated or the trajectory's token budget would be exceeded.

Any engine serves it: each turn is an ordinary `generate` call (n = 1) on prompts whose ids are
the row's prompt followed by the trajectory so far, so the KV-cache-free HF engine and vLLM (text
prompts go to it as token ids) see exactly the tokens the trainer will score. The result is one
Rollout per trajectory whose response is every action and observation in order, with
`trained` = 0 on the observations (in the sequence, out of every loss).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import partial
from typing import Callable, Generator

from vlrft.data.encoding import PromptEncoder
from vlrft.engines.base import RolloutEngine, SamplingParams, derived_seed
from vlrft.errors import ConfigError
from vlrft.models.collate import concat_mm_inputs
from vlrft.multiturn.environment import EnvironmentFailure, Step, as_step
from vlrft.multiturn.host import EnvironmentHost, Held
from vlrft.multiturn.in_flight import InFlight
from vlrft.multiturn.template import ObservationTemplate
from vlrft.types import Prompt, Rollout


@dataclass
class MultiTurn:
    environments: EnvironmentHost  # a fresh environment per trajectory, in a worker process of its own
    template: ObservationTemplate
    max_turns: int
    max_tokens: int  # response tokens per trajectory: actions and observations together
    encoder: PromptEncoder | None = None  # turns observation images into pixel inputs (VL models)
    # Whether the step's budget for reward and environment calls bounds the calls (not those of
    # a batch an async rollout rank started ahead: the budget restarts with each step).
    step_budget: bool = True
    shows_images: bool = True  # False: the environment said its observations are text only


@dataclass
class Trajectory:
    prompt: Prompt
    environment: Held | None
    ids: list[int] = field(default_factory=list)
    trained: list[int] = field(default_factory=list)
    logprobs: list[float] | None = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)
    truncated: bool = False
    done: bool = False
    types: list[int] = field(default_factory=list)  # per token of ids: 0 text, 1 image pad
    images: list = field(default_factory=list)  # the observations' images, in order
    mm_inputs: dict = field(default_factory=dict)  # their pixel inputs, concatenated

    def continuation(self) -> Prompt:
        """The prompt of the next turn: the row's prompt and everything since, with the pixel
        inputs and modality ids of every image in it (the prompt's and the observations')."""
        p, sofar = self.prompt, self.rollout()
        return replace(p, prompt_ids=p.prompt_ids + self.ids, mm_token_types=sofar.mm_token_types(),
                       mm_inputs=sofar.mm_inputs(), images=p.images + self.images)

    def add(self, ids: list[int], logprobs: list[float] | None, trained: int, types: list[int] | None = None) -> None:
        self.ids += ids
        self.trained += [trained] * len(ids)
        self.types += types or [0] * len(ids)
        if self.logprobs is None:
            return
        if trained and logprobs is None:
            self.logprobs = None  # the engine reports no logprobs
        else:  # observations get 0: out of the loss, and out of the engine-gap metrics
            self.logprobs += list(logprobs) if trained else [0.0] * len(ids)

    def rollout(self) -> Rollout:
        return Rollout(
            prompt=self.prompt,
            group_id=self.prompt.index,
            response_ids=self.ids,
            response_text=self.turns[-1]["action"] if self.turns else "",
            truncated=self.truncated,
            logprobs=self.logprobs,
            trained=self.trained,
            turns=self.turns,
            observation_images=self.images,
            observation_mm_inputs=self.mm_inputs,
            response_mm_token_types=self.types if self.images else [],
        )


def start(trajectory: Trajectory, mt: MultiTurn, fields: dict) -> None:
    """A fresh environment for the trajectory, reset to its row; a failure ends it unstarted."""
    try:
        trajectory.environment = mt.environments.construct(_call("construction", trajectory), mt.step_budget)
    except EnvironmentFailure as failure:
        return fail(trajectory, f"construction {failure}")
    try:
        mt.environments.reset(trajectory.environment, fields, _call("reset", trajectory), mt.step_budget)
    except EnvironmentFailure as failure:
        fail(trajectory, f"reset {failure}")


def _call(name: str, trajectory: Trajectory) -> str:
    return f"environment {name} on sample {trajectory.prompt.id!r}"


def fail(trajectory: Trajectory, message: str) -> None:
    """An environment failure ends the trajectory; the turn records it (counted in the metrics)."""
    print(f"vlrft: environment failed on row {trajectory.prompt.id!r}: {message}", flush=True)
    if trajectory.turns:
        trajectory.turns[-1]["error"] = message
    else:
        trajectory.turns.append({"action": "", "observation": "", "reward": 0.0, "error": message})
    trajectory.done = True


def record(trajectory: Trajectory, action: Rollout) -> bool:
    """Record a generated turn; whether the environment answers it (the trajectory goes on)."""
    trajectory.add(action.response_ids, action.logprobs, trained=1)
    # last_token: the turn's last generated token in the response (where a per-turn reward goes)
    turn = {"action": action.response_text, "observation": "", "reward": 0.0, "last_token": len(trajectory.ids) - 1}
    trajectory.turns.append(turn)
    trajectory.truncated = action.truncated
    if action.truncated or not action.response_ids:
        trajectory.done = True
    return not trajectory.done


def take_step(trajectory: Trajectory, mt: MultiTurn) -> Step | EnvironmentFailure:
    """The environment's answer to the trajectory's last turn (in one of the host's threads)."""
    try:
        action = trajectory.turns[-1]["action"]
        return as_step(mt.environments.step(trajectory.environment, action, _call("step", trajectory), mt.step_budget))
    except EnvironmentFailure as failure:
        return failure


def answer(trajectory: Trajectory, step: Step | EnvironmentFailure, mt: MultiTurn, last_action: list[int],
           max_new_tokens: int, last_turn: bool) -> None:
    """Append the environment's answer as the template wraps it, unless the trajectory ends."""
    if isinstance(step, EnvironmentFailure):
        return fail(trajectory, f"step {step}")
    turn = trajectory.turns[-1]
    turn["reward"] = step.reward
    if step.done or last_turn:
        trajectory.done = True
        return
    try:
        image_parts, mm_inputs, images = observation_images(step.images, mt, trajectory.prompt.id)
    except EnvironmentFailure as failure:
        return fail(trajectory, f"step {failure}")
    observation = mt.template.observation_ids(last_action[-1], step.observation, image_parts)
    # The next turn must fit whole: the observation and a full-length action.
    if observation is None or len(trajectory.ids) + len(observation) + max_new_tokens > mt.max_tokens:
        trajectory.done = True
        return
    turn["observation"] = step.observation
    if images:
        turn["images"] = len(images)
        trajectory.images += images
        trajectory.mm_inputs = concat_mm_inputs([trajectory.mm_inputs, mm_inputs])
    trajectory.add(observation, None, trained=0, types=mt.encoder.token_types(observation) if images else None)


def observation_images(shown: list, mt: MultiTurn, row_id: str) -> tuple[str, dict, list]:
    """An observation's images: their image parts as the template writes them (one pad per
    merged patch), pixel inputs and the loaded images; ("", {}, []) without images.
    EnvironmentFailure for an image that cannot be read or used; ConfigError when the run's
    model takes no images in an observation turn."""
    if not shown:
        return "", {}, []
    if not mt.shows_images:  # (the vision tower was not declared for them: trainer/vision_modalities.py)
        raise EnvironmentFailure(f"showed {len(shown)} image(s) on row {row_id!r}, but its class says shows_images = False")
    if mt.template.image_part is None or mt.encoder is None or mt.encoder.image_processor is None:
        raise ConfigError(f"the environment showed images on row {row_id!r}: images in observations need a "
                          "vision-language model (its chat template writes image parts in the observation turn) and rollout.engine: hf")
    try:
        images = [mt.encoder.load_image(i) if isinstance(i, str) else i.convert("RGB") for i in shown]
        mm_inputs = mt.encoder.image_inputs(images, f"row id {row_id!r}")
    except Exception as err:  # noqa: BLE001 - PIL and the image processor raise many types
        raise EnvironmentFailure(f"showed an image that cannot be used ({err})") from None
    return mt.encoder.expand_image_pads(mt.template.image_part * len(images), mm_inputs, "", len(images)), mm_inputs, images


Calls = list  # a batch of environment calls: [function making calls into a trajectory's environment]


def multi_turn_steps(
    engine: RolloutEngine, prompts: list[Prompt], params: SamplingParams, mt: MultiTurn, fields_of: Callable[[Prompt], dict]
) -> Generator[Calls, list, list[Rollout]]:
    """params.n trajectories per prompt, grouped by prompt like `engine.generate`'s rollouts,
    as a generator: it yields each batch of environment calls (the constructions, then each
    turn's steps) and takes their results back, so that whoever drives it
    (vlrft.multiturn.in_flight) may do other work while they run. Every rank runs the same
    number of generate calls (max_turns) so a TP engine's group stays together; a rank whose
    trajectories all ended sends none of its own."""
    if not getattr(engine, "continues_image_prompts", True):
        with_images = next((p for p in prompts if p.images or p.mm_inputs), None)
        if with_images is not None:
            raise ConfigError(f"row id {with_images.id!r} has images: multi-turn rollouts of image prompts need rollout.engine: hf")
        mt = replace(mt, encoder=None)  # images in observations: refused too (observation_images)
    trajectories = [Trajectory(p, None) for p in prompts for _ in range(params.n)]
    yield [partial(start, t, mt, fields_of(t.prompt)) for t in trajectories]
    for turn in range(mt.max_turns):
        running = [t for t in trajectories if not t.done]
        turn_params = replace(params, n=1, seed=None if params.seed is None else derived_seed(params.seed, turn))
        actions = engine.generate([t.continuation() for t in running], turn_params)
        stepping = [(t, action) for t, action in zip(running, actions) if record(t, action)]
        # The turn's environment calls, at the same time.
        steps = yield [partial(take_step, t, mt) for t, _ in stepping]
        for (t, action), step in zip(stepping, steps):
            answer(t, step, mt, action.response_ids, params.max_new_tokens, last_turn=turn + 1 == mt.max_turns)
    mt.environments.release([t.environment for t in trajectories if t.environment is not None])
    return [t.rollout() for t in trajectories]


def multi_turn_generate(
    engine: RolloutEngine, prompts: list[Prompt], params: SamplingParams, mt: MultiTurn, fields_of: Callable[[Prompt], dict]
) -> list[Rollout]:
    """The trajectories of `multi_turn_steps`, generated in one go."""
    return InFlight(multi_turn_steps(engine, prompts, params, mt, fields_of), mt.environments).finish()


def generate_rollouts(
    engine: RolloutEngine, prompts: list[Prompt], params: SamplingParams, mt: MultiTurn | None, fields_of: Callable[[Prompt], dict]
) -> list[Rollout]:
    """One turn (`engine.generate`) or multi-turn trajectories, by the run's settings."""
    if mt is None:
        return engine.generate(prompts, params)
    return multi_turn_generate(engine, prompts, params, mt, fields_of)
