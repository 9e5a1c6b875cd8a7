"""KL-Cov entropy control (algo/cov_control.py), by hand."""

import torch

from vlrft.algo.cov_control import covariances, kl_cov_terms


def alone(t: torch.Tensor) -> torch.Tensor:  # a world of one: the gather returns what it is given
    return t


LOGP = torch.tensor([[-0.1, -2.0, -0.5], [-1.0, -0.2, -3.0]], dtype=torch.float64)
OLD = torch.tensor([[-0.3, -2.0, -0.4], [-1.0, -0.6, -3.0]], dtype=torch.float64)
ADV = torch.tensor([[2.0, 2.0, 0.0], [-1.0, 1.0, 0.0]], dtype=torch.float64)
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)  # the last token is padding


def test_covariances_by_hand():
    # valid tokens: A = [2, 2, 0, -1, 1] (mean 0.8), logp = [-0.1, -2, -0.5, -1, -0.2] (mean -0.76)
    want = [(2 - 0.8) * (-0.1 + 0.76), (2 - 0.8) * (-2 + 0.76), (0 - 0.8) * (-0.5 + 0.76),
            (-1 - 0.8) * (-1 + 0.76), (1 - 0.8) * (-0.2 + 0.76)]  # 0.792, -1.488, -0.208, 0.432, 0.112
    torch.testing.assert_close(covariances(LOGP, ADV, MASK, alone), torch.tensor(want, dtype=torch.float64))


def test_the_top_tokens_by_covariance_get_the_term_and_its_gradient():
    logp = LOGP.clone().requires_grad_()
    # ratio 0.4 of 5 tokens: ceil(2) = the two largest covariances, tokens (0, 0) 0.792 and (1, 0) 0.432
    terms = kl_cov_terms(logp, OLD, ADV, MASK, ratio=0.4, coef=2.0, gather=alone)
    want = torch.zeros_like(LOGP)
    want[0, 0] = 2.0 * abs(-0.1 + 0.3)  # 0.4
    want[1, 0] = 2.0 * abs(-1.0 + 1.0)  # 0: the policy has not moved there yet
    torch.testing.assert_close(terms, want)
    terms.sum().backward()
    grad = torch.zeros_like(LOGP)
    grad[0, 0] = 2.0  # d/dlogp of 2|logp - old| with logp > old
    torch.testing.assert_close(logp.grad, grad)  # (1, 0) sits at |0|'s kink: torch's sign(0) = 0


def test_ratio_zero_adds_nothing_and_every_rank_counts():
    assert kl_cov_terms(LOGP, OLD, ADV, MASK, ratio=0.0, coef=1.0, gather=alone).abs().sum() == 0
    # Another rank's tokens shift the means and enter the top-k: gathering [mine, theirs]
    theirs = torch.tensor([5.0, 5.0, 5.0], dtype=torch.float64)

    def two_ranks(t):
        return torch.cat([t, theirs if t.numel() == 5 else t])

    cov = covariances(LOGP, ADV, MASK, two_ranks)
    a, lp = torch.tensor([2.0, 2.0, 0.0, -1.0, 1.0, 5, 5, 5]), torch.tensor([-0.1, -2.0, -0.5, -1.0, -0.2, 5, 5, 5])
    torch.testing.assert_close(cov.float(), ((a[:5] - a.mean()) * (lp[:5] - lp.mean())).float())
