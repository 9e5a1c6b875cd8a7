"""Logprobs and entropy from hidden states, one chunk of tokens at a time.

The LM head's [T, V] logits (V ~ 150k for Qwen) are the largest tensor of an RL forward. Here
they exist for at most `chunk_tokens` tokens at a time, in the forward pass and, through
activation checkpointing of each chunk, in the backward pass too.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from vlrft.algo.entropy import token_entropy

LOGIT_CHUNK_TOKENS = 1024  # 1024 x 150k fp32 logits = 0.6 GB: bounded whatever the batch


def _chunk_stats(hidden: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module, temperature: float):
    # The head's matmul in the caller's autocast dtype; logsumexp and softmax in fp32.
    logits = head(hidden).float() / temperature  # [c, V] this chunk only
    lse = torch.logsumexp(logits, dim=-1)  # [c]
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse  # [c]
    return logp, token_entropy(logits)  # [c], [c]


def chunked_token_stats(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: torch.nn.Module,
    temperature: float,
    chunk_tokens: int = LOGIT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprob of each target, entropy of its distribution), both [N], from hidden [N, H]."""
    logps, entropies = [], []
    for start in range(0, hidden.shape[0], chunk_tokens):
        args = (hidden[start : start + chunk_tokens], targets[start : start + chunk_tokens], head, temperature)
        if torch.is_grad_enabled():
            # Recompute the chunk's logits in backward instead of keeping them. No metadata
            # check of the recomputed tensors: under ZeRO-3 a frozen head (LoRA) is released
            # right after its recompute and gathered again for its own backward, so the check,
            # which runs in between, would see an empty partition where the weight was.
            logp, entropy = checkpoint(_chunk_stats, *args, use_reentrant=False, determinism_check="none")
        else:
            logp, entropy = _chunk_stats(*args)
        logps.append(logp)
        entropies.append(entropy)
    if not logps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(logps), torch.cat(entropies)
