"""The critic: the policy's backbone (vision tower included) with a scalar value head."""

from __future__ import annotations


import torch

from vlrft.models.packing import forward_inputs, predictor_rows
from vlrft.models.attention import decoder_autocast
from vlrft.models.loader import load_model
from vlrft.models.sequence_parallel import decoder_hidden, local_tokens, sequence_shard_of
from vlrft.types import MicroBatch


class ValueModel(torch.nn.Module):
    """V(s) for every prefix: a linear head on the backbone's last hidden state."""

    def __init__(self, causal_lm: torch.nn.Module):
        super().__init__()
        # `.model` of an HF causal / image-text-to-text LM is the decoder with its vision
        # tower; the LM head is dropped.
        self.backbone = causal_lm.model
        self.compute_dtype = causal_lm.compute_dtype  # the decoder's autocast dtype (loader)
        hidden = causal_lm.config.get_text_config().hidden_size
        self.value_head = torch.nn.Linear(hidden, 1)
        # Zero init: the first values are 0, so the first GAE advantages are the returns.
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, packed: MicroBatch | None = None, **inputs) -> torch.Tensor:
        """Values [B, L] of `inputs` (`packing.forward_inputs` of the micro-batch `packed`)."""
        with decoder_autocast(self):
            hidden, _ = decoder_hidden(self.backbone, sequence_shard_of(self), packed, inputs, {})  # [B, L, H]
        # The head in its own dtype (fp32, or bf16 under DeepSpeed's bf16 mode), values in fp32.
        return self.value_head(hidden.to(self.value_head.weight.dtype)).float().squeeze(-1)  # [B, L]


def load_value_model(path: str, attention: str = "sdpa", compute_dtype: str = "float32") -> ValueModel:
    """A critic initialised from an HF checkpoint (usually the policy's) with a fresh head."""
    return ValueModel(load_model(path, attention, compute_dtype))


def token_values(critic: torch.nn.Module, batch: MicroBatch) -> torch.Tensor:
    """Value of the state before each token, at the token's own position (as logprobs). [B, L].
    With sequence parallelism, at this rank's shard's tokens only (0 at the others')."""
    inner = getattr(critic, "module", critic)  # a DeepSpeed engine wraps the value model
    values = critic(packed=batch, **forward_inputs(inner.backbone, batch))  # [B, L] value after reading position p
    before = values.gather(1, predictor_rows(batch).to(values.device))  # [B, L] value after reading the token's predictor
    values = torch.nn.functional.pad(before[:, 1:], (1, 0))  # a row's first token has none
    return values * local_tokens(values.shape[1], sequence_shard_of(inner), values.device)
