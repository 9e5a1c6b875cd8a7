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
    top_logp: torch.Tensor | None = None  # [B, L, k] logprobs of the ids asked for by `top_ids`, when asked


@dataclass
class TeacherScores:
    """A frozen teacher's view of the response tokens, 0 elsewhere (`teacher_scores`)."""

    logp: torch.Tensor  # [B, L] logprob of each sampled token
    argmax: torch.Tensor  # [B, L] 1.0 where the sampled token is the teacher's most likely
    top_ids: torch.Tensor | None = None  # [B, L, k] the teacher's k most likely tokens (long), with top_k
    top_logp: torch.Tensor | None = None  # [B, L, k] their logprobs


def policy_forward(
    model: torch.nn.Module,
    batch: MicroBatch,
    temperature: float,
    moe_aux: bool = False,
    keep_logits: bool = False,
    chunk_tokens: int = LOGIT_CHUNK_TOKENS,
    top_ids: torch.Tensor | None = None,
) -> ForwardOut:
    """Logprobs and entropy at the response tokens, from logits divided by the sampling
    temperature (so they are those of the distribution the engine sampled from); with
    `top_ids` ([B, L, k] ids at each response token: distillation's teacher's top-k), also the
    logprobs of those ids at each response token's position (`top_logp`).

    The decoder runs once; the LM head runs only on the positions that predict response
    tokens, a chunk at a time, unless `keep_logits` (the exact vocabulary KL needs them all).
    """
    inner = getattr(model, "module", model)  # a DeepSpeed engine wraps the HF model
    extra = {"output_router_logits": True} if moe_aux else {}
    # A LoRA policy's reference is the policy with adapters off (models/lora.py BaseModelView).
    context = getattr(model, "forward_context", contextlib.nullcontext)
    with decoder_autocast(inner), context():
        hidden, base = _decoder(inner, batch, extra)
        return _head_stats(inner, batch, hidden, base, temperature, moe_aux, keep_logits, chunk_tokens, top_ids)


def _decoder(inner, batch: MicroBatch, extra: dict):
    """The decoder's last hidden states [B, L, H] (vision tower included) and its output. With
    sequence parallelism the whole row's, this rank having run its shard (sequence_parallel.py)."""
    return decoder_hidden(inner.model, sequence_shard_of(inner), batch, forward_inputs(inner.model, batch), extra)


@torch.no_grad()
def teacher_scores(model: torch.nn.Module, batch: MicroBatch, temperature: float, top_k: int = 0,
                   student_vocab: int | None = None, chunk_tokens: int = LOGIT_CHUNK_TOKENS) -> TeacherScores:
    """A frozen teacher's view of the response tokens (logprobs as `policy_forward` computes
    them), with `top_k` its k most likely tokens at each among the ids the student's head has
    (`student_vocab`; a teacher's head may have more rows: Qwen2.5-7B's 152,064 against 0.5B's
    151,936). The LM head runs a chunk of tokens at a time (the logits are [chunk, V])."""
    inner = getattr(model, "module", model)
    with decoder_autocast(inner):
        hidden, _ = _decoder(inner, batch, {})
        scored = scored_tokens(inner, batch, hidden.device)  # [B, L]
        sample, token = scored.nonzero(as_tuple=True)
        predicting = hidden[sample, predictor_rows(batch).to(hidden.device)[sample, token]]  # [N, H]
        targets = batch.input_ids.to(hidden.device)[sample, token]  # [N]
        vocab = min(student_vocab or inner.lm_head.out_features, inner.lm_head.out_features)
        k = min(top_k, vocab)
        logps, tops, top_ids, top_logps = [], [], [], []
        for start in range(0, predicting.shape[0], chunk_tokens):
            logits = inner.lm_head(predicting[start : start + chunk_tokens]).float() / temperature  # [c, V]
            target = targets[start : start + chunk_tokens]
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [c, 1]
            logps.append((logits.gather(-1, target[:, None]) - lse).squeeze(-1))
            tops.append((logits.argmax(dim=-1) == target).float())
            best, ids = logits[:, :vocab].topk(k, dim=-1)  # [c, k]
            top_ids.append(ids)
            top_logps.append(best - lse)

    def place(chunks: list[torch.Tensor], width: tuple = (), dtype=torch.float32) -> torch.Tensor:
        """[N, ...] chunks -> [B, L, ...] in `dtype`, also with no chunks: with sequence
        parallelism a shard may hold no response token, and the group sums its zeros."""
        out = torch.zeros(scored.shape + width, device=hidden.device, dtype=dtype)
        if chunks:
            out[scored] = torch.cat(chunks).to(dtype)
        return out

    scores = TeacherScores(place(logps), place(tops))
    if top_k:
        scores.top_ids, scores.top_logp = place(top_ids, (k,), torch.long), place(top_logps, (k,))
    return scores


def _head_stats(
    inner, batch: MicroBatch, hidden: torch.Tensor, base, temperature: float, moe_aux: bool, keep_logits: bool, chunk_tokens: int,
    top_ids: torch.Tensor | None,
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
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # [B, L-1, 1]
        logp = (logits.gather(-1, targets.unsqueeze(-1)) - lse).squeeze(-1)  # [B, L-1]
        keep = scored[:, 1:].float()
        out = ForwardOut(_shift(logp * keep), _shift(token_entropy(logits) * keep), logits, aux)
        if top_ids is not None:  # [B, L-1, k] for tokens 1..L-1, then at each token's own position
            # (gathered from the logits, not from a log_softmax of them: no second [B, L-1, V] kept for backward)
            chosen = (logits.gather(-1, top_ids[:, 1:].to(hidden.device).long()) - lse) * keep[..., None]
            out.top_logp = torch.nn.functional.pad(chosen, (0, 0, 1, 0))
        return out
    if not scored.any():
        # Nothing to score (empty responses): a zero still wired through the whole model, so the
        # backward reaches every parameter on every rank, as the sharded backends expect. It
        # goes through the same LM-head call (models/fused_head.py) as one scored token: ZeRO-3
        # gathers parameters per module call (the fused head: per call), so every rank makes
        # one call per micro-batch (and the chunked head as many chunks as the busiest rank).
        zero, _, _ = head_token_stats(inner, hidden[0, :1], batch.input_ids[0, :1].to(hidden.device), temperature, chunk_tokens)
        logp = hidden.new_zeros(scored.shape, dtype=torch.float32) + 0.0 * zero.sum()
        top_logp = None if top_ids is None else torch.zeros(top_ids.shape, device=hidden.device) + 0.0 * zero.sum()
        return ForwardOut(logp=logp, entropy=torch.zeros_like(logp).detach(), aux_loss=aux, top_logp=top_logp)
    sample, token = scored.nonzero(as_tuple=True)  # [N] each, in row order
    targets = batch.input_ids.to(hidden.device)[sample, token]  # [N]
    also = None if top_ids is None else top_ids.to(hidden.device)[sample, token].long()  # [N, k]
    logp_sel, entropy_sel, also_sel = head_token_stats(inner, hidden[sample, rows[sample, token]], targets, temperature,
                                                       chunk_tokens, also)
    logp = logp_sel.new_zeros(scored.shape).masked_scatter(scored, logp_sel)  # [B, L] fp32
    entropy = entropy_sel.new_zeros(scored.shape).masked_scatter(scored, entropy_sel)  # [B, L] fp32
    out = ForwardOut(logp=logp, entropy=entropy, aux_loss=aux)
    if top_ids is not None:
        out.top_logp = also_sel.new_zeros(top_ids.shape)
        out.top_logp[scored] = also_sel  # [B, L, k]
    return out


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
