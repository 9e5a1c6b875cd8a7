"""Cost of the exact weight-sync check (guards.sync_digest) against the sync it checks.

    python bench/sync_digest.py [--shapes tiny 1.5B] [--engine-dtype float32 bfloat16] [--repeats 3]

Per shape (Qwen2.5 text dimensions, tied embedding, random weights; the trainer's tensors in
fp32) and engine dtype, on this machine's device:

- sync:    what the HF engine's `update_weights` does, every tensor copied into the engine's
           (cast to its dtype);
- sent:    the trainer's digests of the tensors as it sends them, in the engine's dtype;
- served:  the engine's digests of what it holds afterwards;
- check/sync = (sent + served) / sync: what the check adds to a sync, as a ratio (an
  in-process copy is the cheapest sync there is: vLLM's reload and a broadcast to rollout ranks
  cost more, so the ratio is an upper bound for them).

Best of `--repeats` for each. Memory: the 1.5B shape holds 1.5e9 fp32 trainer values and the
engine's copy (9 GiB with a bf16 engine).
"""

from __future__ import annotations

import argparse
import time

import torch

from vlrft.engines.weight_digest import tensor_digest

# hidden, layers, attention heads, kv heads, MLP width (as bench/gpu_step.py), vocabulary.
SHAPES = {
    "tiny": (128, 2, 4, 2, 256, 640),
    "1.5B": (1536, 28, 12, 2, 8960, 151_936),
}


def named_shapes(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of each parameter of a Qwen2-shaped causal LM with a tied head."""
    hidden, layers, heads, kv_heads, mlp, vocab = SHAPES[shape]
    kv = hidden // heads * kv_heads
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [(p + "self_attn.q_proj.weight", (hidden, hidden)), (p + "self_attn.q_proj.bias", (hidden,)),
                   (p + "self_attn.k_proj.weight", (kv, hidden)), (p + "self_attn.k_proj.bias", (kv,)),
                   (p + "self_attn.v_proj.weight", (kv, hidden)), (p + "self_attn.v_proj.bias", (kv,)),
                   (p + "self_attn.o_proj.weight", (hidden, hidden)), (p + "mlp.gate_proj.weight", (mlp, hidden)),
                   (p + "mlp.up_proj.weight", (mlp, hidden)), (p + "mlp.down_proj.weight", (hidden, mlp)),
                   (p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,))]
    return shapes + [("model.norm.weight", (hidden,))]


def best_of(repeats: int, work) -> float:
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        start = time.perf_counter()
        work()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def measure(shape: str, engine_dtype: torch.dtype, repeats: int, device: str) -> dict:
    generator = torch.Generator(device).manual_seed(0)
    trainer = {name: torch.randn(size, generator=generator, device=device) * 0.02 for name, size in named_shapes(shape)}
    engine = {name: torch.empty_like(tensor, dtype=engine_dtype) for name, tensor in trainer.items()}

    def sync():
        for name, tensor in trainer.items():
            engine[name].copy_(tensor)

    sync_s = best_of(repeats, sync)
    sent_s = best_of(repeats, lambda: [tensor_digest(t, engine_dtype) for t in trainer.values()])
    served_s = best_of(repeats, lambda: [tensor_digest(t) for t in engine.values()])
    sent = {name: tensor_digest(t, engine_dtype) for name, t in trainer.items()}
    assert sent == {name: tensor_digest(t) for name, t in engine.items()}, "the digests of a healthy sync differ"
    return {"params": sum(t.numel() for t in trainer.values()), "sync_s": sync_s, "sent_s": sent_s, "served_s": served_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["tiny", "1.5B"], choices=list(SHAPES))
    parser.add_argument("--engine-dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"device {device}, {torch.get_num_threads()} threads; trainer tensors fp32, best of {args.repeats}")
    print(f"{'shape':>6} {'engine':>9} {'params':>14} {'sync s':>9} {'sent s':>9} {'served s':>9} {'check/sync':>11}")
    for shape in args.shapes:
        for dtype in args.engine_dtype:
            r = measure(shape, getattr(torch, dtype), args.repeats, device)
            ratio = (r["sent_s"] + r["served_s"]) / r["sync_s"]
            print(f"{shape:>6} {dtype:>9} {r['params']:>14,} {r['sync_s']:>9.4f} {r['sent_s']:>9.4f} "
                  f"{r['served_s']:>9.4f} {ratio:>10.2f}x", flush=True)


if __name__ == "__main__":
    main()
