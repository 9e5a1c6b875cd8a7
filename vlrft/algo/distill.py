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
"""

from __future__ import annotations

import torch

DISTILL_MODES = ("advantage", "loss")


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
