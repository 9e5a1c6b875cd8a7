"""DeepSpeed training backend (ZeRO 0/2/3). The only vlrft module that imports deepspeed."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import deepspeed
import torch
import torch.distributed as dist


class DeepSpeedBackend:
    def __init__(self, model: torch.nn.Module, *, lr: float, weight_decay: float, grad_clip: float, zero_stage: int):
        config = {
            "train_micro_batch_size_per_gpu": 1,  # unused: vlrft sizes micro-batches by tokens
            "gradient_accumulation_steps": 1,  # accumulation boundaries are set explicitly
            "gradient_clipping": grad_clip,
            "zero_optimization": {"stage": zero_stage},
            "zero_allow_untested_optimizer": True,  # torch AdamW runs on CPU and GPU alike
            "steps_per_print": 1 << 30,
        }
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        self.zero_stage = zero_stage

    @property
    def model(self) -> torch.nn.Module:
        return self.engine

    @property
    def module(self) -> torch.nn.Module:
        """The wrapped HF model (parameters may be shards under ZeRO-3)."""
        return self.engine.module

    def backward(self, loss: torch.Tensor, boundary: bool) -> None:
        # The loss already carries its global normaliser: no rescaling by accumulation steps.
        self.engine.set_gradient_accumulation_boundary(boundary)
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> float:
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else 0.0

    def named_full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in self.module.named_parameters():
            if self.zero_stage == 3:
                # Collective: every rank gathers the same parameter in the same order.
                with deepspeed.zero.GatheredParameters([param]):
                    yield name, param.data.detach().clone()
            else:
                yield name, param.data.detach()

    def save_hf(self, out_dir: Path) -> None:
        if self.zero_stage == 3:
            state = self.engine._zero3_consolidated_16bit_state_dict()  # collective; full on rank 0
        else:
            state = self.module.state_dict()
        if dist.get_rank() == 0:
            self.module.save_pretrained(out_dir, state_dict=state)
        dist.barrier()
