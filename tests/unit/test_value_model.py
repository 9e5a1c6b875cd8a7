"""The critic: value alignment with tokens, the vision path, and experience values = critic forward."""

import torch

from vlrft.models.collate import collate, gather_responses
from vlrft.models.value_model import ValueModel, load_value_model, token_values
from tests.unit.test_logprob_consistency import build_trainer

GAE = ["algo.advantage=gae", "critic.enabled=true"]


def test_value_of_a_token_is_read_from_the_previous_position(tiny_text):
    critic = load_value_model(tiny_text)
    assert isinstance(critic, ValueModel) and not hasattr(critic, "lm_head")
    torch.nn.init.normal_(critic.value_head.weight)
    ids = torch.tensor([[5, 9, 11, 13]])
    hidden = critic.backbone(input_ids=ids).last_hidden_state[0]  # [4, H]
    head = critic.value_head
    # V for the token at position p is the value of the prefix ending at p - 1; position 0 gets 0.
    expected = torch.cat([torch.zeros(1), (hidden[:-1] @ head.weight[0]) + head.bias])
    from vlrft.types import MicroBatch

    batch = MicroBatch(ids, torch.ones_like(ids), torch.ones_like(ids), {}, [])
    torch.testing.assert_close(token_values(critic, batch)[0], expected)


def test_experience_values_equal_the_critic_forward_with_images(tiny_vl, colour_data, tmp_path, world_of_one):
    trainer = build_trainer(tiny_vl, colour_data, tmp_path, extra=GAE)
    torch.nn.init.normal_(trainer.critic.module.value_head.weight, std=0.1)  # not the zero init
    prompts = [trainer.encoder.encode(trainer.train_rows[row], pos) for pos, row in trainer.sampler.next_indices()]
    assert prompts[0].mm_inputs  # the image path
    experiences, _ = trainer.maker.make(prompts)
    batch = collate(experiences, pad_id=0)
    with torch.no_grad():
        fresh = gather_responses(batch, token_values(trainer.critic.model, batch))
    for e, v in zip(experiences, fresh):
        torch.testing.assert_close(e.values, v, rtol=1e-5, atol=1e-5)
        assert e.returns.shape == e.advantages.shape == v.shape
    assert any(v.abs().sum() > 0 for v in fresh)
