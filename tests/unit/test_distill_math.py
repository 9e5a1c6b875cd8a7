"""On-policy distillation's per-token terms, by hand in float64."""

import math

import torch

from vlrft.algo.distill import distill_advantages, distill_loss_terms, reverse_kl_tokens

STUDENT = torch.tensor([[math.log(0.5), math.log(0.25), math.log(0.1)]], dtype=torch.float64)
TEACHER = torch.tensor([[math.log(0.25), math.log(0.5), math.log(0.1)]], dtype=torch.float64)
MASK = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)  # the third token is the environment's


def test_reverse_kl_per_token():
    # log 0.5 - log 0.25 = log 2; log 0.25 - log 0.5 = -log 2; equal probabilities: 0
    torch.testing.assert_close(reverse_kl_tokens(STUDENT, TEACHER), torch.tensor([[math.log(2), -math.log(2), 0.0]], dtype=torch.float64))


def test_advantage_is_minus_coef_times_d_on_the_students_tokens():
    got = distill_advantages(STUDENT.clone().requires_grad_(), TEACHER, MASK, coef=0.5)
    torch.testing.assert_close(got, torch.tensor([[-0.5 * math.log(2), 0.5 * math.log(2), 0.0]], dtype=torch.float64))
    assert not got.requires_grad  # a constant of the loss


def test_loss_term_is_half_d_squared_with_gradient_d_through_the_student_only():
    logp = STUDENT.clone().requires_grad_()
    teacher = TEACHER.clone().requires_grad_()
    terms = distill_loss_terms(logp, teacher, coef=2.0)
    # 2 * (log 2)^2 / 2 at the first two tokens, 0 at the third
    torch.testing.assert_close(terms, torch.tensor([[math.log(2) ** 2, math.log(2) ** 2, 0.0]], dtype=torch.float64))
    terms.sum().backward()
    # d/dlogp of coef * d^2 / 2 = coef * d: 2 log 2, -2 log 2, 0
    torch.testing.assert_close(logp.grad, torch.tensor([[2 * math.log(2), -2 * math.log(2), 0.0]], dtype=torch.float64))
    assert teacher.grad is None


def test_a_student_equal_to_its_teacher_gets_nothing():
    assert distill_advantages(STUDENT, STUDENT, MASK, 1.0).abs().sum() == 0
    logp = STUDENT.clone().requires_grad_()
    distill_loss_terms(logp, STUDENT, 1.0).sum().backward()
    assert logp.grad.abs().sum() == 0


def test_loss_gradient_is_the_reverse_kls_in_expectation():
    # Two-token vocabulary, student softmax(theta): sum_y pi_s(y) * d(y) * grad log pi_s(y) (the
    # loss's expected gradient under on-policy sampling) equals grad KL(pi_s || pi_T) exactly.
    theta = torch.tensor([0.3, -0.2], dtype=torch.float64, requires_grad=True)
    teacher = torch.log(torch.tensor([0.7, 0.3], dtype=torch.float64))
    kl = (torch.softmax(theta, 0) * (torch.log_softmax(theta, 0) - teacher)).sum()
    (exact,) = torch.autograd.grad(kl, theta)
    expected = torch.zeros(2, dtype=torch.float64)
    for y in range(2):
        logp = torch.log_softmax(theta, 0)[y]
        (grad,) = torch.autograd.grad(distill_loss_terms(logp, teacher[y], 1.0), theta)
        expected += torch.softmax(theta, 0)[y].detach() * grad
    torch.testing.assert_close(expected, exact)
