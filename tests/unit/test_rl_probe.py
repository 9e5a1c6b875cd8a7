"""data_tools/rl_probe.py: the answer-token GRPO bench builds the trainer's loss."""

import pytest
import torch

from data_tools.rl_probe import first_step_at, grpo_loss, main

COLOURS = [0, 1, 2, 3]  # the test vocabulary is the four colours


def test_the_loss_moves_probability_to_the_rewarded_colour():
    logits = torch.zeros(3, 4, requires_grad=True)  # 3 prompts, uniform over 4 colours
    truth = torch.tensor([0, 2, 3])
    loss = grpo_loss(logits.log_softmax(-1), COLOURS, truth, 64, 0.0, "k3", None, torch.Generator().manual_seed(0))
    loss.backward()
    after = (logits - 10.0 * logits.grad).softmax(-1)
    assert (after[torch.arange(3), truth] > 0.25).all()


def test_the_kl_term_is_zero_at_the_reference_and_pulls_back_away_from_it():
    logp = torch.tensor([[2.0, 0.0, 0.0, 0.0]]).log_softmax(-1)
    truth = torch.tensor([0])
    plain = grpo_loss(logp, COLOURS, truth, 8, 0.0, "k3", None, torch.Generator().manual_seed(1))
    at_ref = grpo_loss(logp, COLOURS, truth, 8, 0.5, "k3", logp, torch.Generator().manual_seed(1))
    assert torch.equal(plain, at_ref)
    uniform = torch.full((1, 4), 0.25).log()
    away = grpo_loss(logp, COLOURS, truth, 8, 0.5, "k3", uniform, torch.Generator().manual_seed(1))
    assert away > plain


def test_the_entropy_bonus_spreads_a_confident_answer():
    # A confident policy: the bonus (weighted to dominate the reward term) spreads its answer.
    logits = torch.tensor([[3.0, 0.0, 0.0, 0.0]], requires_grad=True)
    loss = grpo_loss(logits.log_softmax(-1), COLOURS, torch.tensor([0]), 8, 0.0, "k3", None,
                     torch.Generator().manual_seed(0), entropy_coef=10.0)
    loss.backward()
    assert logits.grad[0, 0] > 0 and (logits.grad[0, 1:] < 0).all()  # descent lowers the favourite


def test_first_step_at():
    assert first_step_at([(0, 0.25), (10, 0.5), (20, 0.93)], 0.9) == 20
    assert first_step_at([(0, 0.25)], 0.9) is None


def test_one_step_runs_on_the_tiny_model(tiny_vl, colour_data, capsys):
    main(["--model", tiny_vl, "--data", str(colour_data), "--steps", "1", "--prompts", "2", "--samples", "2",
          "--kl-coef", "0.01", "--entropy-coef", "0.01"])
    line = capsys.readouterr().out
    assert line.startswith("seed 0: 0:") and " 1:" in line and ">= 0.9 at step" in line


def test_a_lora_plus_policy_trains_only_its_adapters(tiny_vl, colour_data, capsys, monkeypatch):
    import data_tools.rl_probe as rl_probe

    optimizers = []
    adamw = torch.optim.AdamW
    monkeypatch.setattr(rl_probe.torch.optim, "AdamW", lambda *a, **kw: optimizers.append(adamw(*a, **kw)) or optimizers[-1])
    main(["--model", tiny_vl, "--data", str(colour_data), "--steps", "1", "--prompts", "2", "--samples", "2",
          "--lr", "0.001", "--lora-rank", "4", "--lora-lr-ratio", "8", "--lora-targets", "q_proj", "v_proj"])
    assert capsys.readouterr().out.startswith("seed 0: 0:")
    a, b = optimizers[0].param_groups  # the A matrices at --lr, the B matrices 8x
    assert b["lr"] == pytest.approx(8 * a["lr"]) and len(a["params"]) == len(b["params"]) == 4
