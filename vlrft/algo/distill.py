"""On-policy distillation (docs/algorithms.md, "On-policy distillation"): the student samples, a
teacher scores each sampled token, and the student is pulled toward the teacher by the
per-token reverse KL, one sample at a time:

    d_t = log pi_s(y_t | prefix) - log pi_T(y_t | prefix)      (y_t sampled from pi_s)

E[d_t] over y_t ~ pi_s is KL(pi_s || pi_T) at that position: a dense signal at every token
instead of one reward per response.

- `advantage` mode: A_t += -coef * d_t (detached, per token, no group normalisation), then the
  usual policy loss; with no reward configured this is pure distillation.
- `loss` mode: coef * d_t^2 / 2 added to each token's loss, with the current student logprobs.
  Its gradient is coef * d_t * grad log pi_s(y_t), whose expectation under on-policy sampling
  is the gradient of the reverse KL; the plain coef * d_t (k1) would contribute
  coef * grad log pi_s(y_t), zero in expectation: noise, not the KL's gradient.
- `jsd` mode: coef * JSD_beta(P || Q) added to each token's loss, over the teacher's top-k
  tokens at that position (GKD, arXiv 2306.13649): P the teacher's and Q the student's
  probabilities of those k tokens, each renormalised on them, M = beta P + (1 - beta) Q,

      JSD_beta(P || Q) = beta KL(P || M) + (1 - beta) KL(Q || M),

  with beta = 0 the forward KL(P || Q) and beta = 1 the reverse KL(Q || P) (the limits of
  JSD_beta / beta and JSD_beta / (1 - beta)). Every top-k token of the teacher pulls, not only
  the sampled one: the gradient is exact at each position, no sampling estimate.
"""

from __future__ import annotations

import math

import torch

DISTILL_MODES = ("advantage", "loss", "jsd")
# jsd: the most top-k tokens a position keeps. Each experience holds k ids and k logprobs per
# response token (8 bytes each) from the experience pass to the update, on the CPU. At least 2:
# renormalised on one token, both distributions are [1] and the divergence is 0.
MIN_TOP_K, MAX_TOP_K = 2, 256


def reverse_kl_tokens(student_logp: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """d_t = log pi_s - log pi_T of each sampled token (any shape, elementwise)."""
    return student_logp - teacher_logp


def distill_advantages(student_logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor, coef: float) -> torch.Tensor:
    """-coef * d_t on the tokens of `mask` (the student's own, trained tokens), 0 elsewhere;
    detached: the advantage is a constant of the loss."""
    return (-coef * reverse_kl_tokens(student_logp, teacher_logp) * mask).detach()


def distill_loss_terms(logp: torch.Tensor, teacher_logp: torch.Tensor, coef: float) -> torch.Tensor:
    """coef * d_t^2 / 2 per token, through the current student logprobs `logp` only (the
    teacher's are constants): added to the token loss before aggregation."""
    return coef * 0.5 * reverse_kl_tokens(logp, teacher_logp.detach()) ** 2


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(a || b) over the last dim from log-probabilities; a token a gives no mass adds 0 (its
    terms zeroed before the product too: -inf - x there would make the backward NaN)."""
    present = log_a > -math.inf
    log_a, log_b = torch.where(present, log_a, 0.0), torch.where(present, log_b, 0.0)
    return torch.where(present, log_a.exp() * (log_a - log_b), 0.0).sum(-1)


def top_k_jsd(student_top: torch.Tensor, teacher_top: torch.Tensor, beta: float) -> torch.Tensor:
    """JSD_beta(P || Q) per token ([...]) from the student's and the teacher's logprobs of the
    teacher's top-k tokens ([..., k], any normaliser: both are renormalised on the k tokens),
    through the student's only (the teacher's are constants). A row of zeros on both sides
    (padding) gives 0."""
    log_q = torch.log_softmax(student_top, dim=-1)
    log_p = torch.log_softmax(teacher_top.detach(), dim=-1)
    if beta == 0.0:
        return _kl(log_p, log_q)
    if beta == 1.0:
        return _kl(log_q, log_p)
    log_m = torch.logsumexp(torch.stack([log_p + math.log(beta), log_q + math.log(1.0 - beta)]), dim=0)
    return beta * _kl(log_p, log_m) + (1.0 - beta) * _kl(log_q, log_m)
