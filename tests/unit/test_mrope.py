"""The shared forward gives Qwen-VL its 3-D M-RoPE positions (a pitfall of peer toolkits)."""

import torch

from vlrft.data.dataset import load_rows
from vlrft.data.encoding import PromptEncoder
from vlrft.models.collate import collate
from vlrft.models.forward import token_logprobs
from vlrft.models.loader import load_model
from vlrft.types import Rollout


def test_forward_uses_mrope_positions(tiny_vl, colour_data):
    encoder = PromptEncoder(tiny_vl, 56 * 56, 112 * 112, 512)
    rows = load_rows(colour_data / "train.jsonl")[:3]
    answer = encoder.tokenizer("<answer>red</answer>", add_special_tokens=False)["input_ids"]
    rollouts = [Rollout(encoder.encode(r, i), i, answer[: i + 1], "", True) for i, r in enumerate(rows)]
    batch = collate(rollouts, pad_id=encoder.tokenizer.pad_token_id)
    assert batch.mm_inputs["mm_token_type_ids"].sum().item() == 3 * 4  # 4 image tokens per prompt
    model = load_model(tiny_vl).eval()
    with torch.no_grad():
        ours = token_logprobs(model, batch, 1.0)
        positions, _ = model.model.get_rope_index(
            batch.input_ids,
            image_grid_thw=batch.mm_inputs["image_grid_thw"],
            attention_mask=batch.attention_mask,
            mm_token_type_ids=batch.mm_inputs["mm_token_type_ids"],
        )  # [3, B, L]
        assert not torch.equal(positions[1], positions[2])  # height and width ids differ on images
        logits = model(**batch.model_inputs(), position_ids=positions).logits
        inputs_1d = {k: v for k, v in batch.model_inputs().items() if k != "mm_token_type_ids"}
        logits_1d = model(**inputs_1d).logits
    explicit = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    flat = torch.log_softmax(logits_1d[:, :-1].float(), -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    mask = batch.response_mask[:, 1:].bool()  # the forward scores response tokens
    assert (ours[:, 1:] - explicit)[mask].abs().max().item() <= 1e-5
    assert (flat - explicit)[mask].abs().max().item() > 1e-4  # 1-D positions really are different
