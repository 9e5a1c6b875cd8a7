"""The one logprob forward used by the experience maker and the trainer alike.

Using the same function (same collation, same model inputs, same temperature scaling) for
rollout-time and training-time logprobs is what makes the PPO ratio exactly 1 before the
first update.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlrft.algo.entropy import token_entropy
from vlrft.types import MicroBatch


@dataclass
class ForwardOut:
    logits: torch.Tensor  # [B, L-1, V] temperature-scaled; row p predicts token p+1
    logp: torch.Tensor  # [B, L] logprob of each token given its prefix (0 at position 0)
    aux_loss: torch.Tensor | None  # the MoE router's load-balancing loss, when requested

    def entropy(self) -> torch.Tensor:
        """Entropy of the sampling distribution at each token's position. [B, L]."""
        return torch.nn.functional.pad(token_entropy(self.logits), (1, 0))


def policy_forward(
    model: torch.nn.Module, batch: MicroBatch, temperature: float, moe_aux: bool = False
) -> ForwardOut:
    """Logits divided by the sampling temperature, so logprobs are those the engine sampled from."""
    extra = {"output_router_logits": True} if moe_aux else {}
    out = model(**batch.model_inputs(), use_cache=False, **extra)
    logits = out.logits[:, :-1].float() / temperature  # [B, L-1, V] predicts tokens 1..L-1
    targets = batch.input_ids[:, 1:].unsqueeze(-1)  # [B, L-1, 1]
    logp = logits.gather(-1, targets).squeeze(-1) - torch.logsumexp(logits, dim=-1)  # [B, L-1]
    aux = getattr(out, "aux_loss", None) if moe_aux else None
    return ForwardOut(logits=logits, logp=torch.nn.functional.pad(logp, (1, 0)), aux_loss=aux)


def token_logprobs(
    model: torch.nn.Module, batch: MicroBatch, temperature: float, with_entropy: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each token given its prefix, at the token's own position ([B, L]); with
    `with_entropy`, also the entropy at each token's position ([B, L], same logits)."""
    out = policy_forward(model, batch, temperature)
    return (out.logp, out.entropy()) if with_entropy else out.logp
