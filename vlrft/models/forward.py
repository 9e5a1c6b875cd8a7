"""The one logprob forward used by the experience maker and the trainer alike.

Using the same function (same collation, same model inputs, same temperature scaling) for
rollout-time and training-time logprobs is what makes the PPO ratio exactly 1 before the
first update.
"""

from __future__ import annotations

import torch

from vlrft.algo.entropy import token_entropy
from vlrft.types import MicroBatch


def token_logprobs(
    model: torch.nn.Module, batch: MicroBatch, temperature: float, with_entropy: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each token given its prefix, stored at the token's own position. [B, L].

    Position 0 has no prefix and gets 0. Logits are divided by the sampling temperature so the
    logprobs are those of the distribution the engine sampled from. With `with_entropy`, also
    the entropy of that distribution at each token's position ([B, L], from the same logits).
    """
    logits = model(**batch.model_inputs(), use_cache=False).logits  # [B, L, V]
    logits = logits[:, :-1].float() / temperature  # [B, L-1, V] predicts tokens 1..L-1
    targets = batch.input_ids[:, 1:].unsqueeze(-1)  # [B, L-1, 1]
    logp = logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)  # [B, L-1]
    logp = torch.nn.functional.pad(logp, (1, 0))  # [B, L]
    if not with_entropy:
        return logp
    return logp, torch.nn.functional.pad(token_entropy(logits), (1, 0))  # [B, L]
