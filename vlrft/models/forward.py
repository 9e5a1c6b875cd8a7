"""The one logprob forward used by the experience maker and the trainer alike.

Using the same function (same collation, same model inputs, same temperature scaling) for
rollout-time and training-time logprobs is what makes the PPO ratio exactly 1 before the
first update (in fp32; with bf16 compute a token's logprob also depends on how its micro-batch
was packed, so the first-epoch ratio carries bf16 rounding noise of about 1e-3 when the
experience pass computes the old logprobs; with one optimizer step per batch the update's own
forward supplies them and the ratio is exactly 1 in any precision).

Precision: the decoder and the LM head's matmul run in the compute dtype (autocast; in fp32
nothing changes); the logits are then taken to fp32 for logsumexp, logprobs and entropy, so
the normaliser over a 150k vocabulary never accumulates in bf16.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import torch

from vlrft.algo.entropy import token_entropy
from vlrft.models.packing import forward_inputs, predictor_rows
from vlrft.models.attention import decoder_autocast
from vlrft.models.chunked import LOGIT_CHUNK_TOKENS
from vlrft.models.fused_head import head_token_stats
from vlrft.models.sequence_parallel import decoder_hidden, local_tokens, sequence_shard_of
from vlrft.types import MicroBatch


@dataclass
class ForwardOut:
    logp: torch.Tensor  # [B, L] logprob of each response token given its prefix (0 elsewhere)
    entropy: torch.Tensor  # [B, L] entropy of the sampling distribution at each response token
    logits: torch.Tensor | None = None  # [B, L-1, V] temperature-scaled, [:, p-1] predicting token p; only with keep_logits
    aux_loss: torch.Tensor | None = None  # the MoE router's load-balancing loss, when requested


def policy_forward(
    model: torch.nn.Module,
    batch: MicroBatch,
    temperature: float,
    moe_aux: bool = False,
    keep_logits: bool = False,
    chunk_tokens: int = LOGIT_CHUNK_TOKENS,
) -> ForwardOut:
    """Logprobs and entropy at the response tokens, from logits divided by the sampling
    temperature (so they are those of the distribution the engine sampled from).

    The decoder runs once; the LM head runs only on the positions that predict response
    tokens, a chunk at a time, unless `keep_logits` (the exact vocabulary KL needs them all).
    """
    inner = getattr(model, "module", model)  # a DeepSpeed engine wraps the HF model
    extra = {"output_router_logits": True} if moe_aux else {}
    # A LoRA policy's reference is the policy with adapters off (models/lora.py BaseModelView).
    context = getattr(model, "forward_context", contextlib.nullcontext)
    with decoder_autocast(inner), context():
        hidden, base = _decoder(inner, batch, extra)
        return _head_stats(inner, batch, hidden, base, temperature, moe_aux, keep_logits, chunk_tokens)


def _decoder(inner, batch: MicroBatch, extra: dict):
    """The decoder's last hidden states [B, L, H] (vision tower included) and its output. With
    sequence parallelism the whole row's, this rank having run its shard (sequence_parallel.py)."""
    return decoder_hidden(inner.model, sequence_shard_of(inner), batch, forward_inputs(inner.model, batch), extra)


@torch.no_grad()
def teacher_scores(model: torch.nn.Module, batch: MicroBatch, temperature: float,
                   chunk_tokens: int = LOGIT_CHUNK_TOKENS) -> tuple[torch.Tensor, torch.Tensor]:
    """A frozen teacher's view of the response tokens: ([B, L] logprob of each, as
    `policy_forward` computes it; [B, L] 1.0 where the token is the teacher's most likely),
    0 elsewhere. The LM head runs a chunk of tokens at a time (the logits are [chunk, V])."""
    inner = getattr(model, "module", model)
    with decoder_autocast(inner):
        hidden, _ = _decoder(inner, batch, {})
        scored = scored_tokens(inner, batch, hidden.device)  # [B, L]
        sample, token = scored.nonzero(as_tuple=True)
        predicting = hidden[sample, predictor_rows(batch).to(hidden.device)[sample, token]]  # [N, H]
        targets = batch.input_ids.to(hidden.device)[sample, token]  # [N]
        logps, tops = [hidden.new_zeros(0, dtype=torch.float32)], [hidden.new_zeros(0, dtype=torch.float32)]
        for start in range(0, predicting.shape[0], chunk_tokens):
            logits = inner.lm_head(predicting[start : start + chunk_tokens]).float() / temperature  # [c, V]
            target = targets[start : start + chunk_tokens]
            logps.append(logits.gather(-1, target[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1))
            tops.append((logits.argmax(dim=-1) == target).float())
    logp = torch.zeros(scored.shape, device=hidden.device).masked_scatter(scored, torch.cat(logps))
    return logp, torch.zeros(scored.shape, device=hidden.device).masked_scatter(scored, torch.cat(tops))


def _head_stats(
    inner, batch: MicroBatch, hidden: torch.Tensor, base, temperature: float, moe_aux: bool, keep_logits: bool, chunk_tokens: int
) -> ForwardOut:
    """The LM-head half of `policy_forward` (under its autocast); `hidden` [B, L, H] in the
    compute dtype."""
    aux = router_aux_loss(inner, tuple(r.float() for r in base.router_logits)) if moe_aux else None
    scored = scored_tokens(inner, batch, hidden.device)  # [B, L] the response tokens (this rank's shard's)
    rows = predictor_rows(batch).to(hidden.device)  # [B, L] the position predicting each token
    if keep_logits:
        if sequence_shard_of(inner) is not None:
            raise ValueError("train.sequence_parallel does not compute the exact vocabulary KL (algo.kl.estimator full) yet")
        predicting = hidden.gather(1, rows[:, 1:, None].expand(-1, -1, hidden.shape[-1]))  # [B, L-1, H] for tokens 1..L-1
        logits = inner.lm_head(predicting).float() / temperature  # [B, L-1, V]
        targets = batch.input_ids[:, 1:].to(hidden.device)  # [B, L-1]
        logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)  # [B, L-1]
        keep = scored[:, 1:].float()
        return ForwardOut(_shift(logp * keep), _shift(token_entropy(logits) * keep), logits, aux)
    if not scored.any():
        # Nothing to score (empty responses): a zero still wired through the whole model, so the
        # backward reaches every parameter on every rank, as the sharded backends expect. It
        # goes through the same LM-head call (models/fused_head.py) as one scored token: ZeRO-3
        # gathers parameters per module call (the fused head: per call), so every rank makes
        # one call per micro-batch (and the chunked head as many chunks as the busiest rank).
        zero, _ = head_token_stats(inner, hidden[0, :1], batch.input_ids[0, :1].to(hidden.device), temperature, chunk_tokens)
        logp = hidden.new_zeros(scored.shape, dtype=torch.float32) + 0.0 * zero.sum()
        return ForwardOut(logp=logp, entropy=torch.zeros_like(logp).detach(), aux_loss=aux)
    sample, token = scored.nonzero(as_tuple=True)  # [N] each, in row order
    targets = batch.input_ids.to(hidden.device)[sample, token]  # [N]
    logp_sel, entropy_sel = head_token_stats(inner, hidden[sample, rows[sample, token]], targets, temperature, chunk_tokens)
    logp = logp_sel.new_zeros(scored.shape).masked_scatter(scored, logp_sel)  # [B, L] fp32
    entropy = entropy_sel.new_zeros(scored.shape).masked_scatter(scored, entropy_sel)  # [B, L] fp32
    return ForwardOut(logp=logp, entropy=entropy, aux_loss=aux)


def scored_tokens(inner, batch: MicroBatch, device) -> torch.Tensor:
    """[B, L] True at the response tokens this rank scores: all of them, or with sequence
    parallelism those of its own shard (each token's loss computed once in the group)."""
    scored = batch.response_mask.bool().to(device)
    return scored & local_tokens(scored.shape[1], sequence_shard_of(inner), device)


def router_aux_loss(causal_lm: torch.nn.Module, router_logits) -> torch.Tensor:
    """The MoE load-balancing loss, by the model's own function, over every token (packed
    batches have no padding, so no mask is needed)."""
    balance = sys.modules[type(causal_lm).__module__].load_balancing_loss_func
    return balance(router_logits, causal_lm.num_experts, causal_lm.num_experts_per_tok, None)


def _shift(per_position: torch.Tensor) -> torch.Tensor:
    """Values computed at position p (predicting token p+1) stored at the token's own position."""
    return torch.nn.functional.pad(per_position, (1, 0))  # [B, L]


def token_logprobs(
    model: torch.nn.Module, batch: MicroBatch, temperature: float, with_entropy: bool = False
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Response-token logprobs ([B, L], 0 elsewhere); with `with_entropy`, also the entropy."""
    out = policy_forward(model, batch, temperature)
    return (out.logp, out.entropy) if with_entropy else out.logp
