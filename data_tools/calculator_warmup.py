"""The tiny text model of the calculator example (examples/calculator): the addition-format
checkpoint of ``make_tiny_model``, then a warm-up on the calculator conversation.

On a product question ("What is 37 * 52? ...") it learns two first turns, drawn at random:
the calculator call that restates the question (CALL_RATE of the time), or a guessed
"<answer>N</answer>" with N a random product. After the calculator's result it learns to
answer with that result. Which first turn pays is left to RL: a guess is almost never right,
so the policy has to learn to call. The after-call prompts are the conversation the
multi-turn rollout builds (question, the call, the result as a `tool` turn), rendered by the
same chat template.

CLI::

    python -m data_tools.calculator_warmup --out DIR [--base artifacts/tiny-text] [--steps 1500] [--seed 0]
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from data_tools.make_tiny_model import MAX_PROMPT_TOKENS, build_text_model
from data_tools.synth_shapes import PRODUCT_OPERANDS, format_answer, product_row
from data_tools.tiny_warmup import copy_base, parse_answer, sft_batch, warm_up_and_save, warmup_cli
from vlrft.data.encoding import PromptEncoder

# Mostly guessing at the start: held-out accuracy begins near zero, and what RL adds (calling)
# is plain in the curve.
CALL_RATE = 0.3


def calculator_call(a: int, b: int) -> str:
    """The turn that asks the built-in calculator for a * b (Qwen/Hermes tool-call format)."""
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": f"{a} * {b}"}}) + "</tool_call>"


def random_pairs(rng: np.random.Generator, n: int) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in rng.choice(PRODUCT_OPERANDS, size=2)) for _ in range(n)]


def calculator_prompts(encoder, rng: np.random.Generator, n: int) -> tuple[list, list, list]:
    """``n`` first-turn prompts, the ``n`` after-call prompts of the same questions, and their
    operand pairs."""
    first, after, pairs = [], [], random_pairs(rng, n)
    for i, (a, b) in enumerate(pairs):
        row = product_row(f"calculator-warmup-{i}", a, b)
        first.append(encoder.encode(row, i))
        row["messages"] += [{"role": "assistant", "content": calculator_call(a, b)}, {"role": "tool", "content": str(a * b)}]
        after.append(encoder.encode(row, i))
    return first, after, pairs


def guesses(rng: np.random.Generator, n: int) -> list[str]:
    return [format_answer(a * b) for a, b in random_pairs(rng, n)]


@torch.no_grad()
def turn_rates(model, tokenizer, first: list, after: list, pairs: list) -> dict:
    """Sampled first turns that call (with the question's numbers) or guess, and greedy
    after-call turns that repeat the result."""
    def generate(prompts, do_sample):
        width = max(len(p.prompt_ids) for p in prompts)  # left-padded: prompts differ in length
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p.prompt_ids)) + p.prompt_ids for p in prompts])
        mask = torch.tensor([[0] * (width - len(p.prompt_ids)) + [1] * len(p.prompt_ids) for p in prompts])
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=96, do_sample=do_sample,
                             temperature=1.0, top_k=0, top_p=1.0)
        return tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)

    torch.manual_seed(0)
    first_turns, after_turns = generate(first, True), generate(after, False)
    return {"first_calls": sum(t.strip() == calculator_call(a, b) for t, (a, b) in zip(first_turns, pairs)) / len(first),
            "first_guesses": sum(parse_answer(t) is not None for t in first_turns) / len(first),
            "after_repeats_result": sum(parse_answer(t) == str(a * b) for t, (a, b) in zip(after_turns, pairs)) / len(after)}


def build_calculator_model(out_dir, base=None, steps: int = 1500, seed: int = 0, batch_size: int = 32, lr: float = 3e-3) -> Path:
    out_dir = copy_base(out_dir, base, build_text_model, seed)
    encoder = PromptEncoder(str(out_dir), 0, 0, MAX_PROMPT_TOKENS)
    model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32)
    rng = np.random.default_rng(seed)

    def make_batch() -> dict:
        first, after, pairs = calculator_prompts(encoder, rng, batch_size // 2)
        calls = [calculator_call(a, b) if call else guess
                 for (a, b), call, guess in zip(pairs, rng.random(len(pairs)) < CALL_RATE, guesses(rng, len(pairs)))]
        results = [format_answer(a * b) for a, b in pairs]
        return sft_batch(encoder.tokenizer, first + after, calls + results)

    def check() -> dict:
        return turn_rates(model, encoder.tokenizer, *calculator_prompts(encoder, np.random.default_rng(seed + 1), 64))

    return warm_up_and_save(model, make_batch, steps, lr, seed, check, "calculator", out_dir)


def main(argv=None) -> None:
    warmup_cli(argv, __doc__.split("\n")[0], build_calculator_model, 1500, "text")


if __name__ == "__main__":
    main()
