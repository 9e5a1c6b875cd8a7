"""Estimated GPU memory per rank for Qwen2.5-class policies: which settings fit on which GPUs.

    python bench/memory_table.py [--gpu-gib 80]

An estimate from the byte counts of what vlrft keeps (not a measurement): model states of the
policy under each DeepSpeed setting, plus the frozen reference and the rollout engine's weights.
Activations (bounded by train.micro_batch_tokens; gradient checkpointing cuts them to one layer;
a second table estimates one long sample's by train.sequence_parallel), the LM-head chunk (models/chunked.py) and vLLM's KV cache (rollout.vllm_memory_fraction, asleep
during the update) come on top; "fits" leaves 25% of the card for them.
"""

from __future__ import annotations

import argparse

GIB = 2**30

# Parameter counts of the real checkpoints (text decoder + vision tower for the VL ones).
MODELS = {"Qwen2.5-1.5B": 1.54e9, "Qwen2.5-VL-3B": 3.75e9, "Qwen2.5-VL-7B": 8.29e9}
# Their rank-64 LoRA adapters on every attention and MLP projection (decoder and vision tower),
# r * (in + out) per adapted linear: e.g. the 7B's 28 decoder layers hold 5.77M each, its 32
# vision blocks 1.39M each.
LORA_64 = {"Qwen2.5-1.5B": 0.074e9, "Qwen2.5-VL-3B": 0.164e9, "Qwen2.5-VL-7B": 0.206e9}


def policy_state_bytes(params: float, ranks: int, zero_stage: int, offload: str) -> float:
    """Bytes on one GPU for the trained policy's weights, gradients and Adam states.

    ZeRO 0-2 (bf16 by autocast): fp32 weights 4P on every rank; fp32 gradients, fp32 master
    partition and Adam's two moments, 4 + 4 + 8 = 16P, split over ranks (stage 2; stage 0 keeps
    them whole); offload moves the master weights and Adam states (12P) to CPU memory. ZeRO-3 in
    DeepSpeed's bf16 mode: bf16 weights 2, gradients summed in fp32 4, fp32 master 4, Adam 8: 18P
    split over ranks; offload moves the gradient partition with the master weights and Adam
    states (16P) to CPU memory, `all` the weights as well.
    """
    if zero_stage == 0:
        return 20 * params
    if zero_stage in (1, 2):
        cpu_side = 12 * params / ranks if offload != "none" else 0.0
        return 4 * params + 16 * params / ranks - cpu_side
    per_rank = 18 * params / ranks
    if offload == "optimizer":
        per_rank -= 16 * params / ranks
    if offload == "all":
        per_rank = 0.0  # only the layer being computed is gathered on the GPU
    return per_rank


def lora_state_bytes(params: float, adapters: float, ranks: int, zero_stage: int) -> float:
    """Bytes on one GPU for a LoRA policy (model.lora): the frozen base weights and the adapters
    in fp32 (4 bytes each, sharded under ZeRO-3), the adapters' gradients, master copy and Adam
    moments (16 bytes each, split over the ranks). The reference is the base with adapters off:
    no second copy."""
    weights = 4 * (params + adapters) / (ranks if zero_stage == 3 else 1)
    return weights + 16 * adapters / (ranks if zero_stage else 1)


def row(name: str, params: float, ranks: int, zero_stage: int, offload: str, gpu_gib: float, lora: bool = False) -> str:
    if lora:
        policy = lora_state_bytes(params, LORA_64[name], ranks, zero_stage)
        reference = 0.0  # the policy's own base weights, adapters off (models/lora.py)
    else:
        policy = policy_state_bytes(params, ranks, zero_stage, offload)
        reference = 2 * params  # frozen, held in bf16 under bf16 compute (trainer/build.py: load_reference)
    # The engine's copy while it serves: vLLM bf16 weights (sleeps during the update), the HF
    # engine's bf16 copy (stays). Counted once: the peak is the update or the rollout.
    engine_weights = 2 * params
    total = policy + reference + engine_weights
    fits = "yes" if total <= 0.75 * gpu_gib * GIB else "no"
    setting = f"ZeRO-{zero_stage}" + (f" + offload {offload}" if offload != "none" else "") + (" + LoRA r64" if lora else "")
    return (f"| {name} | {ranks} | {setting} | {policy / GIB:6.1f} | {reference / GIB:5.1f} | "
            f"{engine_weights / GIB:5.1f} | {total / GIB:6.1f} | {fits} |")


# Decoder shapes (layers, hidden, MLP intermediate) of the text decoders above.
DECODERS = {"Qwen2.5-1.5B": (28, 1536, 8960), "Qwen2.5-VL-3B": (36, 2048, 11008), "Qwen2.5-VL-7B": (28, 3584, 18944)}
LONG_SAMPLE_TOKENS = 32768


def long_sample_activation_bytes(name: str, tokens: int, sequence_parallel: int) -> float:
    """Bytes of one `tokens`-token sample's activations on one rank in bf16 with gradient
    checkpointing and train.sequence_parallel N: each layer's input kept, L x T/N x H x 2, plus
    one layer's recompute in its backward, about T/N x (8 H + 3 I) x 2 (norms, q/k/v/o, attention
    output, the MLP's gate, up and product), plus what stays whole on every rank: the input
    embeddings and the gathered last hidden states, 2 x T x H x 2. An estimate of the terms that
    scale with the sample (the LM head's 1,024-token chunk, about 0.6 GiB in fp32, comes on top)."""
    layers, hidden, intermediate = DECODERS[name]
    shard = tokens / sequence_parallel
    return 2 * (layers * shard * hidden + shard * (8 * hidden + 3 * intermediate) + 2 * tokens * hidden)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu-gib", type=float, default=80.0, help="memory of one GPU (H100: 80)")
    args = parser.parse_args()
    print(f"Estimated GiB per GPU (bf16 compute, {args.gpu_gib:.0f} GiB cards; 'fits' keeps 25% for activations and KV cache)")
    print("| model | GPUs | DeepSpeed | policy states | reference | engine weights | total | fits |")
    print("|---|---|---|---|---|---|---|---|")
    settings = [(1, 2, "none"), (1, 3, "optimizer"), (1, 3, "all"), (8, 2, "none"), (8, 3, "none"), (8, 3, "optimizer")]
    for name, params in MODELS.items():
        for ranks, stage, offload in settings:
            print(row(name, params, ranks, stage, offload, args.gpu_gib))
        for ranks, stage in ((1, 2), (8, 3)):
            print(row(name, params, ranks, stage, "none", args.gpu_gib, lora=True))
    print(f"\nEstimated GiB per GPU of one {LONG_SAMPLE_TOKENS:,}-token sample's activations (bf16, gradient checkpointing), "
          "by train.sequence_parallel N (long_sample_activation_bytes)")
    print("| model | N = 1 | N = 2 | N = 4 | N = 8 |")
    print("|---|---|---|---|---|")
    for name in DECODERS:
        cells = " | ".join(f"{long_sample_activation_bytes(name, LONG_SAMPLE_TOKENS, n) / GIB:5.1f}" for n in (1, 2, 4, 8))
        print(f"| {name} | {cells} |")


if __name__ == "__main__":
    main()
