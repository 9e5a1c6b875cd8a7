"""On-policy distillation's per-token terms, by hand in float64."""

import math

import torch

from vlrft.algo.distill import distill_advantages, distill_loss_terms, reverse_kl_tokens, top_k_jsd

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


# jsd mode: the teacher's top-2 tokens hold 0.8 of its mass, split 3:1, so renormalised on them
# P = (0.75, 0.25); the student gives both 0.3, so Q = (0.5, 0.5).
TEACHER_TOP = torch.tensor([[math.log(0.6), math.log(0.2)]], dtype=torch.float64)
STUDENT_TOP = torch.tensor([[math.log(0.3), math.log(0.3)]], dtype=torch.float64)


def test_jsd_by_hand_at_beta_0_half_and_1():
    forward_kl = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)
    reverse_kl = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    # beta 0.5: M = (0.625, 0.375)
    half = 0.5 * (0.75 * math.log(0.75 / 0.625) + 0.25 * math.log(0.25 / 0.375)) \
        + 0.5 * (0.5 * math.log(0.5 / 0.625) + 0.5 * math.log(0.5 / 0.375))
    for beta, want in ((0.0, forward_kl), (0.5, half), (1.0, reverse_kl)):
        torch.testing.assert_close(top_k_jsd(STUDENT_TOP, TEACHER_TOP, beta), torch.tensor([want], dtype=torch.float64))
    # beta 0.25: M = 0.25 P + 0.75 Q = (0.5625, 0.4375)
    quarter = 0.25 * (0.75 * math.log(0.75 / 0.5625) + 0.25 * math.log(0.25 / 0.4375)) \
        + 0.75 * (0.5 * math.log(0.5 / 0.5625) + 0.5 * math.log(0.5 / 0.4375))
    torch.testing.assert_close(top_k_jsd(STUDENT_TOP, TEACHER_TOP, 0.25), torch.tensor([quarter], dtype=torch.float64))


def test_jsd_gradient_by_hand_through_the_student_only():
    # Forward KL(P || softmax(s)) has gradient q - p in the student's logits on the support.
    student = STUDENT_TOP.clone().requires_grad_()
    teacher = TEACHER_TOP.clone().requires_grad_()
    top_k_jsd(student, teacher, 0.0).sum().backward()
    torch.testing.assert_close(student.grad, torch.tensor([[0.5 - 0.75, 0.5 - 0.25]], dtype=torch.float64))
    assert teacher.grad is None
    # Reverse KL(Q || P): q_j (log q_j - log p_j - KL)
    student.grad = None
    top_k_jsd(student, TEACHER_TOP, 1.0).sum().backward()
    kl = 0.5 * math.log(4 / 3)
    want = [0.5 * (math.log(0.5 / 0.75) - kl), 0.5 * (math.log(0.5 / 0.25) - kl)]
    torch.testing.assert_close(student.grad, torch.tensor([want], dtype=torch.float64))


def test_jsd_of_a_student_equal_to_its_teacher_and_of_padding_is_zero():
    for beta in (0.0, 0.3, 1.0):
        student = TEACHER_TOP.clone().requires_grad_()
        divergence = top_k_jsd(student, TEACHER_TOP, beta)
        divergence.sum().backward()
        assert divergence.abs().max() < 1e-12 and student.grad.abs().max() < 1e-12
        assert top_k_jsd(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4), beta).abs().sum() == 0  # padded positions


def test_jsd_over_the_whole_vocabulary_is_the_exact_divergence():
    # With k = V nothing is cut: beta 1 is KL(pi_s || pi_T) over the vocabulary, whatever the
    # normaliser the logprobs came with.
    torch.manual_seed(0)
    student, teacher = torch.randn(3, 7, dtype=torch.float64), torch.randn(3, 7, dtype=torch.float64)
    log_s, log_t = torch.log_softmax(student, -1), torch.log_softmax(teacher, -1)
    exact = (log_s.exp() * (log_s - log_t)).sum(-1)
    torch.testing.assert_close(top_k_jsd(student + 4.0, teacher - 1.0, 1.0), exact)


def test_jsd_with_a_token_of_probability_zero_stays_finite_with_finite_gradients():
    # A -inf logprob (a token the model rules out) on either side: no NaN in value or gradient.
    student = torch.tensor([[math.log(0.5), math.log(0.5), -math.inf]], dtype=torch.float64, requires_grad=True)
    teacher = torch.tensor([[math.log(0.5), math.log(0.25), math.log(0.25)]], dtype=torch.float64)
    for beta in (0.0, 0.5):
        for s, t in ((student, teacher), (teacher.clone().requires_grad_(), student.detach())):
            divergence = top_k_jsd(s, t, beta)
            (grad,) = torch.autograd.grad(divergence.sum(), s)
            assert torch.isfinite(grad).all(), (beta, s)
            assert torch.isfinite(divergence).all() or beta == 0.0  # KL(P || Q) with Q = 0 where P > 0 is infinite
