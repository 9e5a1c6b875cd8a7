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
    """`targets` [c, 1 + k]: each token's own id, then k more whose logprobs are wanted too."""
    # The head's matmul in the caller's autocast dtype; logsumexp and softmax in fp32.
    logits = head(hidden).float() / temperature  # [c, V] this chunk only
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [c, 1]
    logp = logits.gather(-1, targets) - lse  # [c, 1 + k]
    return logp, token_entropy(logits)  # [c, 1 + k], [c]


def head_calls(head: torch.nn.Module, chunks: int) -> int:
    """How many times this rank calls `head`: its own `chunks`, or under ZeRO-3 (the head's
    weight partitioned across ranks) the most any rank of the group makes. ZeRO-3 gathers a
    module's parameters in every call, forward and backward, a collective of all ranks: a rank
    with fewer response tokens, so fewer chunks, would leave its peers' gathers unanswered."""
    if not hasattr(head.weight, "ds_id"):
        return chunks
    from vlrft.distributed import all_reduce_max_int

    return all_reduce_max_int(chunks)


def chunked_token_stats(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    head: torch.nn.Module,
    temperature: float,
    chunk_tokens: int = LOGIT_CHUNK_TOKENS,
    also: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob of each target, entropy of its distribution, both [N]; the logprobs of the ids
    in `also` [N, k], [N, 0] without it) from hidden [N, H] (N >= 1 under ZeRO-3: each rank
    calls this once per micro-batch, with a token at least)."""
    if also is None:
        also = targets.new_zeros(targets.shape[0], 0)
    targets = torch.cat([targets[:, None], also], dim=1)  # [N, 1 + k]
    logps, entropies = [], []
    starts = list(range(0, hidden.shape[0], chunk_tokens))
    # Under ZeRO-3, calls on the first token that add nothing (x 0) but are in the graph, so
    # backward gathers for them too: as many head calls as the busiest rank.
    repeats = [0] * (head_calls(head, len(starts)) - len(starts))
    for start, repeat in [(s, False) for s in starts] + [(s, True) for s in repeats]:
        end = start + (1 if repeat else chunk_tokens)
        args = (hidden[start:end], targets[start:end], head, temperature)
        if torch.is_grad_enabled():
            # Recompute the chunk's logits in backward instead of keeping them. No metadata
            # check of the recomputed tensors: under ZeRO-3 a frozen head (LoRA) is released
            # right after its recompute and gathered again for its own backward, so the check,
            # which runs in between, would see an empty partition where the weight was.
            logp, entropy = checkpoint(_chunk_stats, *args, use_reentrant=False, determinism_check="none")
        else:
            logp, entropy = _chunk_stats(*args)
        if repeat:
            logps[0] = logps[0] + 0.0 * logp.sum()
            continue
        logps.append(logp)
        entropies.append(entropy)
    if not logps:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty, hidden.new_zeros(targets.shape[0], targets.shape[1] - 1, dtype=torch.float32)
    logp = torch.cat(logps)  # [N, 1 + k]
    return logp[:, 0], torch.cat(entropies), logp[:, 1:]
