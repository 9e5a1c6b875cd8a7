"""Chunked logprobs/entropy (and other ids' logprobs) equal the naive full-logits computation,
values and gradients."""

import pytest
import torch

from vlrft.algo.entropy import token_entropy
from vlrft.models.chunked import chunked_token_stats
from vlrft.models.forward import policy_forward


def naive(hidden, targets, head, temperature, also):
    logits = head(hidden).float() / temperature  # [N, V]
    every = torch.log_softmax(logits, -1)
    return every.gather(-1, targets[:, None]).squeeze(-1), token_entropy(logits), every.gather(-1, also)


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_chunked_stats_and_gradients_equal_naive(chunk):
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False)
    hidden = torch.randn(7, 8, requires_grad=True)
    targets = torch.randint(0, 50, (7,))
    also = torch.randint(0, 50, (7, 3))  # three more ids per token (distillation's teacher's top-k)
    weights = torch.randn(7)  # an arbitrary downstream use of all outputs
    got = chunked_token_stats(hidden, targets, head, 0.7, chunk_tokens=chunk, also=also)
    want = naive(hidden, targets, head, 0.7, also)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)

    def use(logp, entropy, others):
        return ((logp + 0.1 * entropy + 0.3 * others.sum(-1)) * weights).sum()

    grads_got = torch.autograd.grad(use(*got), [hidden, head.weight])
    grads_want = torch.autograd.grad(use(*want), [hidden, head.weight])
    for g, w in zip(grads_got, grads_want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


def test_no_tokens_gives_empty_results():
    head = torch.nn.Linear(4, 9)
    logp, entropy, others = chunked_token_stats(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long), head, 1.0)
    assert logp.shape == entropy.shape == (0,) and others.shape == (0, 0)


def test_response_only_forward_equals_the_full_logits_forward(tiny_vl, colour_data):
    from vlrft.data.dataset import load_rows
    from vlrft.data.encoding import PromptEncoder
    from vlrft.models.collate import collate
    from vlrft.models.loader import load_model
    from vlrft.types import Rollout

    encoder = PromptEncoder(tiny_vl, 56 * 56, 112 * 112, 512)
    rows = load_rows(colour_data / "train.jsonl")[:3]
    answer = encoder.tokenizer("<answer>red</answer>", add_special_tokens=False)["input_ids"]
    batch = collate([Rollout(encoder.encode(r, i), i, answer[: 2 * i + 1], "", True) for i, r in enumerate(rows)], 0)
    model = load_model(tiny_vl).eval()
    with torch.no_grad():
        fast = policy_forward(model, batch, 0.8, chunk_tokens=2)
        full = policy_forward(model, batch, 0.8, keep_logits=True)
    mask = batch.response_mask.bool()
    assert fast.logp[~mask].abs().sum() == 0 and fast.logp[mask].abs().sum() > 0
    torch.testing.assert_close(fast.logp, full.logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(fast.entropy, full.entropy, rtol=0, atol=1e-5)
