"""Model FLOPs of a policy update and the MFU they make (`perf/mfu`), counted as
bench/gpu_step.py counts them, so a run's log and the benchmark agree:

    decoder:   6 x (matmul parameters per decoder layer) x layers x tokens
    attention: 6 x 2 x layers x (heads x head_dim) x (query, key) pairs, causal: s^2 / 2 for a
               sequence of s tokens; a response after a shared prompt of P tokens adds R x P
    LM head:   6 x hidden x vocab x scored tokens (the head runs on response tokens only)

(6 = forward and backward, 2 FLOPs per multiply-add.) The vision tower and a checkpointed
layer's recomputation are not counted: work done, not model FLOPs. MFU divides the FLOPs per
second per GPU by the card's dense bf16 peak.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlrft.types import MicroBatch

# Dense bf16 tensor-core peaks in TFLOP/s (no sparsity), by a name torch.cuda.get_device_name()
# contains; the first match wins (so "H100 PCIe" before "H100").
PEAK_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("A10G", 70.0),
)


def peak_tflops(device_name: str) -> float | None:
    """The card's dense bf16 peak, or None for a card not in the table (no MFU then)."""
    return next((peak for name, peak in PEAK_TFLOPS if name in device_name), None)


@dataclass(frozen=True)
class FlopCount:
    layers: int
    attention_width: int  # heads x head_dim
    layer_matmul_params: int  # q, k, v, o projections and the MLP's (active) matrices
    hidden: int
    vocab: int

    @classmethod
    def of(cls, model: torch.nn.Module) -> FlopCount:
        """From a causal LM's (or image-text model's) text config."""
        text = model.config.get_text_config()
        hidden, heads = text.hidden_size, text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or hidden // heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        mlp = getattr(text, "moe_intermediate_size", None) or text.intermediate_size
        experts = getattr(text, "num_experts_per_tok", None) or 1  # a mixture of experts: the active ones
        projections = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
        return cls(text.num_hidden_layers, heads * head_dim, projections + 3 * hidden * mlp * experts, hidden, text.vocab_size)

    def micro_batch(self, batch: MicroBatch) -> float:
        """Training FLOPs (forward and backward) of one micro-batch, packed or padded rows."""
        if batch.seq_lengths is None:  # right-padded rows: each row's own tokens
            lengths, parents = batch.attention_mask.sum(dim=1).tolist(), None
        else:
            lengths, parents = batch.seq_lengths, [segment.parent for segment in batch.segments]
        return self.flops(lengths, parents, int(batch.response_mask.sum()))

    def flops(self, lengths: list[int], parents: list[int] | None, scored: int, attention: bool = True) -> float:
        """`lengths` of the sequences (segments), `parents[i]` the shared prompt segment that
        segment i continues (-1: none), `scored` the tokens the LM head runs on. Without
        `attention`, the "6N" count: matmul parameters times tokens only."""
        pairs = sum(s * s / 2 for s in lengths)
        for i, parent in enumerate(parents or []):
            if parent >= 0:
                pairs += lengths[i] * lengths[parent]
        decoder = self.layer_matmul_params * self.layers * sum(lengths)
        score_attention = 2 * self.layers * self.attention_width * pairs if attention else 0.0
        return 6.0 * (decoder + score_attention + self.hidden * self.vocab * scored)


def throughput_metrics(flops: float, tokens: float, seconds: float, gpus: int, device_name: str | None) -> dict[str, float]:
    """`perf/tokens_per_second_per_gpu` and `perf/mfu` (percent of the card's peak) of an update
    that did `flops` over `tokens` on `gpus` GPUs in `seconds`; {} off CUDA (`device_name`
    None), no MFU for a card without a known peak."""
    if device_name is None or seconds <= 0:
        return {}
    metrics = {"perf/tokens_per_second_per_gpu": tokens / seconds / gpus}
    peak = peak_tflops(device_name)
    if peak is not None:
        metrics["perf/mfu"] = 100.0 * flops / seconds / gpus / (peak * 1e12)
    return metrics
