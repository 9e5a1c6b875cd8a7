"""What each KL estimator optimises when it is put in the loss (`algo.kl.placement: loss`).

The loss holds `kl(logπ(a), logπref(a))` at tokens a sampled from π, differentiated through
logπ only (the sampling is not). Its expected gradient over a ~ π is, for a categorical π:
  k1: 0                       (E_π[∇logπ] = 0: k1 in the loss does nothing on average)
  k2: ∇ KL(π ‖ πref)          (the reverse KL the reward-KL objective means)
  k3: ∇ KL(πref ‖ π)          (the forward KL: mass-covering, it pushes up every answer the
                               reference likes, however wrong; docs/algorithms.md, "KL")
Checked exactly by summing over the four actions.
"""

import torch

from vlrft.algo.kl import kl_k1, kl_k2, kl_k3

LOGITS = torch.tensor([2.0, 0.5, -0.3, -1.0], dtype=torch.float64)
REF = torch.tensor([0.25, 0.25, 0.25, 0.25], dtype=torch.float64)


def expected_loss_gradient(estimator) -> torch.Tensor:
    """Σ_a π(a) ∇_z kl(logπ(a), logπref(a)) at z = LOGITS."""
    z = LOGITS.clone().requires_grad_(True)
    logp = z.log_softmax(-1)
    weights = logp.exp().detach()  # the sampling probabilities carry no gradient
    (weights * estimator(logp, REF.log())).sum().backward()
    return z.grad


def divergence_gradient(forward: bool) -> torch.Tensor:
    z = LOGITS.clone().requires_grad_(True)
    logp = z.log_softmax(-1)
    if forward:
        kl = (REF * (REF.log() - logp)).sum()  # KL(ref ‖ π)
    else:
        kl = (logp.exp() * (logp - REF.log())).sum()  # KL(π ‖ ref)
    kl.backward()
    return z.grad


def test_k1_in_the_loss_has_zero_expected_gradient():
    torch.testing.assert_close(expected_loss_gradient(kl_k1), torch.zeros(4, dtype=torch.float64))


def test_k2_in_the_loss_is_the_reverse_kl_gradient():
    torch.testing.assert_close(expected_loss_gradient(kl_k2), divergence_gradient(forward=False))


def test_k3_in_the_loss_is_the_forward_kl_gradient():
    k3 = expected_loss_gradient(kl_k3)
    torch.testing.assert_close(k3, divergence_gradient(forward=True))
    # ... which is not the reverse KL's: it pushes the least likely answer up twice as hard.
    assert k3[3] < 2 * divergence_gradient(forward=False)[3] < 0
