import math

import torch

from vlrft.algo.entropy import entropy_threshold, high_entropy_mask, token_entropy


def test_token_entropy_by_hand():
    # uniform over 4 -> ln 4 ; one-hot-ish [0, -inf...] -> 0 ; two logits (0, ln 3): p = (1/4, 3/4)
    # H = -(1/4 ln 1/4 + 3/4 ln 3/4) = 0.5623
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [0.0, -1e4, -1e4, -1e4], [0.0, math.log(3), -1e4, -1e4]])
    expected = torch.tensor([math.log(4), 0.0, -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))])
    torch.testing.assert_close(token_entropy(logits), expected, atol=1e-5, rtol=0)


def test_threshold_takes_ceil_of_ratio_and_keeps_ties():
    entropies = torch.tensor([0.1, 0.9, 0.5, 0.5, 0.3])
    # ratio 0.3 of 5 tokens -> k = ceil(1.5) = 2 -> 2nd largest = 0.5 ; both 0.5 tokens are kept
    threshold = entropy_threshold(entropies, 0.3)
    assert threshold.item() == 0.5
    assert high_entropy_mask(entropies, threshold).tolist() == [0.0, 1.0, 1.0, 1.0, 0.0]
    assert entropy_threshold(entropies, 0.01) == entropies[1]  # k is at least 1
    assert high_entropy_mask(entropies, entropy_threshold(entropies, 1.0)).tolist() == [1.0] * 5  # rho = 1: all


def test_threshold_of_no_tokens_masks_everything_out():
    assert high_entropy_mask(torch.tensor([0.2]), entropy_threshold(torch.tensor([]), 0.5)).tolist() == [0.0]


def test_token_entropy_gradient_is_the_entropys_at_every_logit():
    """The entropy bonus (algo.entropy_coef) trains through this gradient; the max logit's entry
    once missed a term (its exp(0) = 1 was held constant)."""
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(4, 50, generator=g, dtype=torch.float64)).requires_grad_()
    (got,) = torch.autograd.grad(token_entropy(logits).sum(), logits)
    exact = torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)
    (want,) = torch.autograd.grad(exact.sum(), logits)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(got.sum(-1), torch.zeros(4, dtype=torch.float64), atol=1e-5, rtol=0)  # a shift changes nothing
