"""Multi-turn rollouts: the observation template, tools, environment failures, the rollout loop,
and observation tokens out of every loss."""

import time
from dataclasses import replace
from functools import partial

import pytest
from transformers import AutoTokenizer

from vlrft.data.encoding import PromptEncoder
from vlrft.errors import ConfigError
from vlrft.isolation.budget import STEP_BUDGET, CallStalled
from vlrft.multiturn.environment import EnvironmentFailure, Step, as_step, resolve_environment
from vlrft.multiturn.host import EnvironmentHost, results
from vlrft.multiturn.in_flight import InFlight
from vlrft.multiturn.rollout import MultiTurn, multi_turn_generate, multi_turn_steps
from vlrft.multiturn.template import observation_template
from vlrft.multiturn.tools import ToolEnvironment
from vlrft.engines.base import SamplingParams
from vlrft.types import Prompt, Rollout
from tests.marks import needs_sandbox


@pytest.fixture(scope="module")
def tokenizer(tiny_text):
    return AutoTokenizer.from_pretrained(tiny_text)


def end_of_turn(tokenizer) -> int:
    return tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_observation_tokens_are_what_the_whole_conversation_tokenizes_to(tokenizer):
    """No drift: prompt + action + observation built turn by turn == the re-rendered conversation."""
    stop = end_of_turn(tokenizer)
    template = observation_template(tokenizer, [stop], "tool", "tiny")
    assert template.glue == {stop: "\n<|im_start|>tool\n"} and template.suffix == "<|im_end|>\n<|im_start|>assistant\n"
    question, action, result = "What is 17 * 23?", '<tool_call>{"name": "calculator"}</tool_call>', "391"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(prompt, add_special_tokens=False) + tokenizer.encode(action, add_special_tokens=False) + [stop]
    ids += template.observation_ids(stop, result)
    whole = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}, {"role": "assistant", "content": action}, {"role": "tool", "content": result}],
        tokenize=False, add_generation_prompt=True,
    )
    assert ids == tokenizer.encode(whole, add_special_tokens=False)
    assert template.observation_ids(tokenizer.eos_token_id, result) is None or tokenizer.eos_token_id == stop


def test_a_template_that_rewrites_earlier_turns_is_refused_in_one_line(tokenizer):
    rewriting = tokenizer.chat_template.replace(
        "{% if message['content'] is string %}{{ message['content'] }}",
        "{% if message['content'] is string %}{% if message['role'] == 'assistant' and not loop.last %}"
        "{{ message['content'].split('</think>')[-1] }}{% else %}{{ message['content'] }}{% endif %}",
    )
    assert rewriting != tokenizer.chat_template
    original, tokenizer.chat_template = tokenizer.chat_template, rewriting
    try:
        with pytest.raises(ConfigError, match="not append-only") as err:
            observation_template(tokenizer, [end_of_turn(tokenizer)], "user", "my-model")
    finally:
        tokenizer.chat_template = original
    assert "\n" not in str(err.value) and "my-model" in str(err.value)


def test_a_template_without_image_parts_has_none(tokenizer):
    plain = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}" \
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    original, tokenizer.chat_template = tokenizer.chat_template, plain
    try:
        template = observation_template(tokenizer, [end_of_turn(tokenizer)], "tool", "plain")
    finally:
        tokenizer.chat_template = original
    assert template.image_part is None and template.glue == {end_of_turn(tokenizer): "\n<|im_start|>tool\n"}
    assert observation_template(tokenizer, [end_of_turn(tokenizer)], "tool", "tiny").image_part == "<|vision_start|><|image_pad|><|vision_end|>"


def test_step_answers_are_checked_and_environments_found_by_name():
    assert as_step(("obs", 1, False)) == Step("obs", 1.0, False)
    for bad, why in ((None, "not a Step"), (("obs", "high", False), "not a number"), ((3, 0.0, False), "not text"),
                     (("obs", float("nan"), False), "not finite")):
        with pytest.raises(EnvironmentFailure, match=why):
            as_step(bad)
    assert resolve_environment("tools") is ToolEnvironment
    with pytest.raises(ConfigError, match="unknown environment 'nope'; available: tools"):
        resolve_environment("nope")


class ScriptedEngine:
    """Test double of an engine: each call answers every prompt with the next scripted turn."""

    def __init__(self, turns: list[list[int]], stop: int):
        self.turns, self.stop, self.calls = turns, stop, []

    def generate(self, prompts, params):
        self.calls.append([list(p.prompt_ids) for p in prompts])
        ids = self.turns[len(self.calls) - 1]
        truncated = ids[-1] != self.stop
        return [Rollout(p, p.index, list(ids), f"turn {len(self.calls)}", truncated, [-0.5] * len(ids)) for p in prompts]


# Environments run in a worker process, found there by name: they live in a file.
ENVIRONMENTS = '''
from vlrft.multiturn.environment import Step


class Counting:
    """Answers 'obs' until its third step ('quick' rows: its first); fails on rows whose id
    says so. Counts its constructions in a file beside it (each worker holds one environment at
    a time, so a class attribute would count one): the `fail_at`-th raises (one call at a time)."""

    def __init__(self, fail_at=0):
        if fail_at:
            import pathlib
            built = pathlib.Path(__file__).with_name("constructions")
            count = int(built.read_text() if built.exists() else 0) + 1
            built.write_text(str(count))
            if count == fail_at:
                raise OSError("no more ports")
        self.steps = 0

    def reset(self, sample):
        self.row = sample["id"]
        if self.row == "bad-reset":
            raise ValueError("no such level")

    def step(self, action):
        self.steps += 1
        if self.row == "hangs" and self.steps == 2:
            while True:  # busy, holding its worker's GIL between switches
                pass
        return Step("obs", reward=0.25, done=self.steps == 3 or self.row == "quick")


class Sleeping:
    """Sleeps `seconds` in each step (a sandbox or a web page it waits on); done at the second."""

    def __init__(self, seconds):
        self.seconds, self.steps = seconds, 0

    def reset(self, sample):
        pass

    def step(self, action):
        import os, time
        time.sleep(self.seconds)
        self.steps += 1
        return Step(f"pid {os.getpid()}", reward=1.0, done=self.steps == 2)


class Showing:
    """Answers every turn with "look" and the images it was given."""

    def __init__(self, shown):
        self.shown = shown

    def reset(self, sample):
        pass

    def step(self, action):
        return Step("look", 0.0, False, self.shown)
'''


@pytest.fixture()
def hosted(tmp_path):
    """hosted(Class, **args): an EnvironmentHost of ENVIRONMENTS' Class (timeout 1 s)."""
    (tmp_path / "environments.py").write_text(ENVIRONMENTS)
    hosts = []

    def host(name: str, timeout_s: float = 1.0, workers: int = 1, **args) -> EnvironmentHost:
        hosts.append(EnvironmentHost(f"{tmp_path / 'environments.py'}:{name}", args, timeout_s, workers))
        return hosts[-1]

    yield host
    for h in hosts:
        h.stop()


def prompt(row_id: str, index: int) -> Prompt:
    return Prompt(row_id, "src", "", {}, "", [1, 2, 3], index=index)


def test_multi_turn_rollouts_append_observations_out_of_the_loss(tokenizer, hosted):
    stop = end_of_turn(tokenizer)
    template = observation_template(tokenizer, [stop], "tool", "tiny")
    obs = template.observation_ids(stop, "obs")
    engine = ScriptedEngine([[7, stop], [8, 9, stop], [10, stop], [11, stop]], stop)
    mt = MultiTurn(hosted("Counting", fail_at=7), template, max_turns=4, max_tokens=200)
    fields = lambda p: {"id": p.id}  # noqa: E731
    rows = [prompt("ok", 0), prompt("bad-reset", 1), prompt("ok", 2), prompt("ok", 3)]
    # the 7th construction (row 3's first trajectory) raises
    rollouts = multi_turn_generate(engine, rows, SamplingParams(n=2, max_new_tokens=4, temperature=1.0), mt, fields)
    assert [r.group_id for r in rollouts] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert rollouts[6].response_ids == [] and "construction raised OSError: no more ports" in rollouts[6].turns[0]["error"]
    assert rollouts[7].response_ids == rollouts[0].response_ids
    ok = rollouts[0]
    assert ok.response_ids == [7, stop] + obs + [8, 9, stop] + obs + [10, stop]  # done at the third step
    assert [t["last_token"] for t in ok.turns] == [1, len(obs) + 4, 2 * len(obs) + 6]
    assert ok.trained == [1, 1] + [0] * len(obs) + [1, 1, 1] + [0] * len(obs) + [1, 1]
    assert ok.logprobs == [-0.5, -0.5] + [0.0] * len(obs) + [-0.5] * 3 + [0.0] * len(obs) + [-0.5] * 2
    assert [t["reward"] for t in ok.turns] == [0.25] * 3 and ok.response_text == "turn 3"
    assert not any("error" in t for r in rollouts[4:6] + [rollouts[0], rollouts[7]] for t in r.turns)
    assert engine.calls[1][0] == [1, 2, 3, 7, stop] + obs  # turn 2 continues the very ids of turn 1
    assert len(engine.calls) == 4 and engine.calls[3] == []  # every turn is a call (TP groups stay together)
    bad = rollouts[2]
    assert bad.response_ids == [] and "reset raised ValueError: no such level" in bad.turns[0]["error"]


def warm(host: EnvironmentHost, workers: int) -> None:
    """Start `workers` worker processes and give them back idle, as a first batch would."""
    results(host.release(host.each([partial(host.construct, "warm-up") for _ in range(workers)])))


def test_a_hanging_step_is_killed_and_loses_only_its_own_environment(tokenizer, hosted):
    """8 trajectories, 4 calls at a time (the default `rollout.environment_workers`): the hung
    step ends its own trajectory at the timeout; every other trajectory, however its calls
    were spread over the threads, keeps its environment and goes on to its last turn."""
    stop = end_of_turn(tokenizer)
    template = observation_template(tokenizer, [stop], "tool", "tiny")
    mt = MultiTurn(hosted("Counting", timeout_s=0.5, workers=4), template, max_turns=3, max_tokens=200)
    params = SamplingParams(n=2, max_new_tokens=4, temperature=1.0)
    rows = [prompt("ok", 0), prompt("hangs", 1), prompt("ok", 2), prompt("ok", 3)]
    start = time.monotonic()
    rollouts = multi_turn_generate(ScriptedEngine([[7, stop]] * 3, stop), rows, params, mt, lambda p: {"id": p.id})
    assert time.monotonic() - start < 0.5 + 8.0  # the workers' starts, the hangs' timeouts and kills
    hung = [r for r in rollouts if r.prompt.id == "hangs"]
    assert [t.get("error") for r in hung for t in r.turns] == [None, "step timed out after 0.5s"] * 2
    others = [r for r in rollouts if r.prompt.id != "hangs"]
    assert [len(r.turns) for r in others] == [3] * 6 and not any("error" in t for r in others for t in r.turns)
    again = multi_turn_generate(ScriptedEngine([[7, stop]] * 3, stop), [prompt("ok", 0)], params, mt, lambda p: {"id": p.id})
    assert [len(r.turns) for r in again] == [3, 3] and not any("error" in t for r in again for t in r.turns)


def test_a_turns_environment_calls_run_at_the_same_time_each_trajectory_in_its_own_worker(tokenizer, hosted):
    """8 trajectories whose steps sleep 0.4 s: 4 calls at a time make each turn wait two rounds
    of 0.4 s (not eight, as 1 does); either way each trajectory's environment has a process of
    its own (they answer with their pid), and the trajectories are the same, turn for turn."""
    stop = end_of_turn(tokenizer)
    template = observation_template(tokenizer, [stop], "tool", "tiny")
    params = SamplingParams(n=2, max_new_tokens=4, temperature=1.0)
    rows = [prompt(f"r{i}", i) for i in range(4)]

    def run(workers: int) -> tuple[list, float]:
        mt = MultiTurn(hosted("Sleeping", timeout_s=5.0, workers=workers, seconds=0.4), template, max_turns=3, max_tokens=200)
        warm(mt.environments, 8)
        start = time.monotonic()
        rollouts = multi_turn_generate(ScriptedEngine([[7, stop], [8, stop], [9, stop]], stop), rows, params, mt, lambda p: {})
        return rollouts, time.monotonic() - start

    serial, serial_s = run(1)
    pooled, pooled_s = run(4)
    assert serial_s >= 2 * 8 * 0.4  # two steps per trajectory, one after another
    assert pooled_s < 2 * 2 * 0.4 + 1.0, pooled_s
    turns = lambda rollouts: [(r.prompt.id, [(t["action"], t["reward"]) for t in r.turns]) for r in rollouts]  # noqa: E731
    assert turns(pooled) == turns(serial) == [(f"r{i // 2}", [("turn 1", 1.0), ("turn 2", 1.0)]) for i in range(8)]
    assert len({r.turns[0]["observation"] for r in serial}) == len({r.turns[0]["observation"] for r in pooled}) == 8


def test_each_trajectory_in_flight_has_a_process_and_later_batches_reuse_them(tokenizer, hosted):
    """A process per trajectory in flight, whatever the number of calls at a time (2 here), and
    no more: the next batches run in the first one's workers (their constructions come after
    its releases)."""
    stop = end_of_turn(tokenizer)
    template = observation_template(tokenizer, [stop], "tool", "tiny")
    mt = MultiTurn(hosted("Sleeping", timeout_s=5.0, workers=2, seconds=0.0), template, max_turns=3, max_tokens=200)
    params = SamplingParams(n=2, max_new_tokens=4, temperature=1.0)
    pids = []
    for batch in range(3):
        rows = [prompt(f"r{i}", i) for i in range(2)]
        rollouts = multi_turn_generate(ScriptedEngine([[7, stop]] * 3, stop), rows, params, mt, lambda p: {})
        pids.append({r.turns[0]["observation"] for r in rollouts})
    assert len(pids[0]) == 4 and pids[1] == pids[2] == pids[0] and len(mt.environments.workers) == 4


def test_trajectory_budget_and_turn_limit(tokenizer, hosted):
    stop = end_of_turn(tokenizer)
    template = observation_template(tokenizer, [stop], "tool", "tiny")
    obs = template.observation_ids(stop, "obs")
    environments = hosted("Counting")
    run = lambda turns, budget: multi_turn_generate(  # noqa: E731
        ScriptedEngine([[7, stop]] * 4, stop), [prompt("ok", 0)], SamplingParams(n=1, max_new_tokens=2, temperature=1.0),
        MultiTurn(environments, template, max_turns=turns, max_tokens=budget), lambda p: {"id": p.id})[0]
    assert len(run(1, 200).turns) == 1
    fits_two = 2 + len(obs) + 2  # a next turn starts only when its observation and a full action fit
    assert len(run(4, fits_two).response_ids) == fits_two and len(run(4, fits_two - 1).turns) == 1


@pytest.mark.parametrize("override, message", [
    ("rollout.environment=nope", "unknown environment 'nope'; available: tools"),
    ("rollout.max_turns=0", "'rollout.max_turns' must be >= 1, got 0"),
    ("rollout.max_trajectory_tokens=8", "'rollout.max_trajectory_tokens' (8) must be >= rollout.max_new_tokens (16)"),
    ("rollout.environment_timeout_s=0", "'rollout.environment_timeout_s' must be > 0"),
    ("rollout.environment_workers=0", "'rollout.environment_workers' must be >= 1, got 0"),
])
def test_multi_turn_config_errors_are_one_line(override, message, tiny_text, addition_data):
    from vlrft.config import load_config

    base = [f"model.path={tiny_text}", f"data.train_path={addition_data / 'train.jsonl'}", "rollout.max_new_tokens=16",
            "rollout.environment=tools"]
    with pytest.raises(ConfigError) as err:
        load_config(None, base + [override])
    assert message in str(err.value) and "\n" not in str(err.value)


@needs_sandbox
def test_environment_args_reach_the_environment_and_bad_ones_fail_at_start(tiny_text, addition_data, tokenizer):
    from vlrft.config import load_config
    from vlrft.trainer.build import multi_turn

    base = [f"model.path={tiny_text}", f"data.train_path={addition_data / 'train.jsonl'}", "rollout.environment=tools"]
    stop = [end_of_turn(tokenizer)]
    encoder = PromptEncoder.for_config(load_config(None, base[:2]))
    assert multi_turn(load_config(None, base[:2]), encoder, stop) is None  # no environment: one turn
    mt = multi_turn(load_config(None, base + ["rollout.environment_args={tools: [calculator], max_result_chars: 3}"]), encoder, stop)
    held = mt.environments.construct("construction")
    call = '<tool_call>{"name": "%s", "arguments": {"expression": "1000 * 1000"}}</tool_call>'
    assert mt.environments.step(held, call % "calculator", "step").observation == "100"  # 1000000, cut at 3
    assert mt.environments.step(held, call % "python", "step").observation == "error: unknown tool 'python'; available: calculator"
    mt.environments.stop()
    assert mt.template.glue == {stop[0]: "\n<|im_start|>tool\n"}  # the tools environment answers as role "tool"
    with pytest.raises(ConfigError, match="environment 'tools' could not be built from rollout.environment_args: .*colour"):
        multi_turn(load_config(None, base + ["rollout.environment_args={colour: red}"]), encoder, stop)


def test_an_engine_that_cannot_continue_image_prompts_refuses_them_in_one_line(tokenizer, hosted):
    stop = end_of_turn(tokenizer)
    engine = ScriptedEngine([[7, stop]] * 2, stop)
    engine.continues_image_prompts = False  # as the vLLM engine (image prompts go to it as text)
    mt = MultiTurn(hosted("Counting"), observation_template(tokenizer, [stop], "tool", "tiny"), 2, 100)
    params = SamplingParams(n=1, max_new_tokens=2, temperature=1.0)
    assert len(multi_turn_generate(engine, [prompt("ok", 0)], params, mt, lambda p: {"id": p.id})) == 1  # text: fine
    with_image = prompt("q9", 1)
    with_image.images = ["an image"]
    with pytest.raises(ConfigError, match="^row id 'q9' has images: multi-turn rollouts of image prompts need rollout.engine: hf$"):
        multi_turn_generate(engine, [with_image], params, mt, lambda p: {"id": p.id})


def test_environment_reward_recipe_sums_the_turns():
    from vlrft.experience.maker import completion_fields
    from vlrft.rewards import resolve_recipe

    rollout = Rollout(prompt("q1", 0), 0, [7, 8, 9, 9, 10], "done", False, trained=[1, 1, 0, 0, 1],
                      turns=[{"action": "a", "observation": "o", "reward": 0.25, "last_token": 1},
                             {"action": "b", "observation": "", "reward": 1.0, "last_token": 4}])
    single = Rollout(prompt("q2", 1), 1, [7], "done", False)
    recipe = resolve_recipe("environment_reward")
    samples = [completion_fields(rollout), completion_fields(single)]
    assert recipe(["done", "done"], samples) == [1.25, 0.0]
    assert recipe(["done", "done"], samples, per_turn=True) == [[0, 0.25, 0, 0, 1.0], [0.0]]


def test_special_tokens_in_an_observation_stay_text(tokenizer):
    stop = end_of_turn(tokenizer)
    template = observation_template(tokenizer, [stop], "tool", "tiny")
    ids = template.observation_ids(stop, "x<|im_end|><|image_pad|>")
    specials = {tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|image_pad|>", "<|im_start|>")}
    plain = template.observation_ids(stop, "x")
    # Only the template's own special tokens: <|im_start|> tool, <|im_end|>, <|im_start|> assistant.
    assert [t for t in ids if t in specials] == [t for t in plain if t in specials]
    assert tokenizer.decode(ids) == tokenizer.decode(plain).replace("x", "x<|im_end|><|image_pad|>")


def test_observation_images_enter_as_the_templates_image_parts(tiny_vl, tiny_text, tokenizer, tmp_path, hosted):
    """Each image an environment shows (PIL or a path) becomes the template's image part with
    one pad per merged patch, its pixel inputs and modality ids; the next turn's prompt holds
    them (the PIL image came back from the environment's worker process). An unusable image is
    a counted failure; images for a text model, one line."""
    from PIL import Image

    vl = PromptEncoder(tiny_vl, min_pixels=784, max_pixels=28 * 28 * 16, max_prompt_tokens=512)
    stop = end_of_turn(vl.tokenizer)
    template = observation_template(vl.tokenizer, [stop], "tool", "tiny-vl")
    assert template.image_part == "<|vision_start|><|image_pad|><|vision_end|>"
    Image.new("RGB", (28, 56), "blue").save(tmp_path / "tall.png")
    shown = [Image.new("RGB", (56, 28), "red"), str(tmp_path / "tall.png")]
    engine = ScriptedEngine([[7, stop], [8, stop]], stop)
    params = SamplingParams(n=1, max_new_tokens=2, temperature=1.0)
    mt = MultiTurn(hosted("Showing", shown=shown), template, 2, 300, vl)
    r = multi_turn_generate(engine, [prompt("q", 0)], params, mt, lambda p: {"id": p.id})[0]
    pad, start, end = vl.tokenizer.convert_tokens_to_ids(["<|image_pad|>", "<|vision_start|>", "<|vision_end|>"])
    parts = [start, pad, pad, end] * 2  # 2 x 4 and 4 x 2 patches: two merged tokens each
    observation = template.observation_ids(stop, "look", vl.tokenizer.decode(parts))
    assert r.response_ids == [7, stop] + observation + [8, stop] and parts == [t for t in observation if t in (pad, start, end)]
    assert r.observation_mm_inputs["image_grid_thw"].tolist() == [[1, 2, 4], [1, 4, 2]]
    assert r.observation_images[0].size == (56, 28) and r.turns[0]["images"] == 2
    assert r.response_mm_token_types == [1 if t == pad else 0 for t in r.response_ids]
    assert r.mm_token_types() == [0, 0, 0] + r.response_mm_token_types
    assert engine.calls[1][0] == [1, 2, 3, 7, stop] + observation
    broken = MultiTurn(hosted("Showing", shown=[str(tmp_path / "missing.png")]), template, 2, 300, vl)
    r = multi_turn_generate(ScriptedEngine([[7, stop]] * 2, stop), [prompt("q", 0)], params, broken, lambda p: {})[0]
    assert r.response_ids == [7, stop] and "showed an image that cannot be used" in r.turns[0]["error"]
    text = PromptEncoder(tiny_text, 784, 28 * 28 * 16, 512)
    blind = MultiTurn(hosted("Showing", shown=shown), observation_template(tokenizer, [end_of_turn(tokenizer)], "tool", "t"), 2, 300, text)
    with pytest.raises(ConfigError, match="^the environment showed images on row 'q': images in observations need a vision-language"):
        multi_turn_generate(ScriptedEngine([[7, end_of_turn(tokenizer)]] * 2, stop), [prompt("q", 0)], params, blind, lambda p: {})


class SlowEngine:
    """Test double of an engine that takes `seconds` per call (decoding) and answers each
    prompt by its row: [10 + row index, stop]."""

    def __init__(self, seconds: float, stop: int):
        self.seconds, self.stop = seconds, stop

    def generate(self, prompts, params):
        time.sleep(self.seconds)
        return [Rollout(p, p.index, [10 + p.index, self.stop], f"row {p.index}", False, [-0.5, -0.5]) for p in prompts]


def test_a_batch_in_flight_decodes_while_another_waits_on_its_environments(tokenizer, hosted):
    """Two batches of 4 trajectories, each turn 0.3 s of decoding and 0.4 s of environment (2
    steps each): one after the other they take 2 x 2 x 0.7 s; with the second decoded while the
    first waits (InFlight.finish's `meanwhile`, what an asynchronous rollout rank does) about
    1.7 s. Each batch's trajectories are those it gets alone."""
    stop = end_of_turn(tokenizer)
    template = observation_template(tokenizer, [stop], "tool", "tiny")
    params = SamplingParams(n=1, max_new_tokens=4, temperature=1.0)
    mt = MultiTurn(hosted("Sleeping", timeout_s=5.0, workers=8, seconds=0.4), template, max_turns=3, max_tokens=200)
    host = mt.environments
    warm(host, 8)
    engine = SlowEngine(0.3, stop)
    first, second = [prompt(f"a{i}", i) for i in range(4)], [prompt(f"b{i}", 4 + i) for i in range(4)]
    steps = lambda rows: multi_turn_steps(engine, rows, params, mt, lambda p: {})  # noqa: E731

    start = time.monotonic()
    alone = [InFlight(steps(rows), host).finish() for rows in (first, second)]
    alone_s = time.monotonic() - start
    assert alone_s >= 2 * 2 * (0.3 + 0.4)

    start = time.monotonic()
    ahead: list[InFlight] = []

    def meanwhile() -> bool:
        if not ahead:
            ahead.append(InFlight(steps(second), host))
            return True
        if ahead[0].ready():
            ahead[0].advance()
            return True
        return False

    overlapped = [InFlight(steps(first), host).finish(meanwhile), None]
    overlapped[1] = ahead[0].finish()
    overlapped_s = time.monotonic() - start
    assert overlapped_s < alone_s - 0.8, (overlapped_s, alone_s)
    # (the observations name the worker processes, which the two runs take in another order)
    turns = lambda rollouts: [(r.prompt.id, [i for i, t in zip(r.response_ids, r.trained) if t],  # noqa: E731
                               [t["reward"] for t in r.turns]) for r in rollouts]
    assert [turns(b) for b in overlapped] == [turns(b) for b in alone]
    assert turns(alone[1])[0][2] == [1.0, 1.0]  # both steps answered


def test_a_batch_started_ahead_is_bounded_by_its_timeouts_not_the_steps_budget(tokenizer, hosted):
    """An async rollout rank's batch started ahead (MultiTurn.step_budget False) runs past the
    deadline of the step it started in; a batch of that step is stopped there."""
    stop = end_of_turn(tokenizer)
    template = observation_template(tokenizer, [stop], "tool", "tiny")
    params = SamplingParams(n=1, max_new_tokens=4, temperature=1.0)
    mt = MultiTurn(hosted("Sleeping", timeout_s=5.0, seconds=0.4), template, max_turns=3, max_tokens=200)
    warm(mt.environments, 1)
    engine = ScriptedEngine([[7, stop]] * 6, stop)
    STEP_BUDGET.start(0.5)  # two 0.4 s steps do not fit
    try:
        with pytest.raises(CallStalled, match="step's budget for reward and environment calls ran out"):
            multi_turn_generate(engine, [prompt("r0", 0)], params, mt, lambda p: {})
        STEP_BUDGET.start(0.5)
        (ahead,) = multi_turn_generate(engine, [prompt("r0", 0)], params, replace(mt, step_budget=False), lambda p: {})
    finally:
        STEP_BUDGET.start(0.0)
    assert [t["reward"] for t in ahead.turns] == [1.0, 1.0] and not any("error" in t for t in ahead.turns)
