"""Worker of test_split_invariance's bf16-weights test: the gradient DeepSpeed's bf16 mode
(ZeRO-3, how vlrft runs bf16 compute there) hands the optimizer, read just before the step.

Two responses A and B. A world of one writes three gradients: A's alone, A's micro-batch
backpropagated three times, and A then B as two micro-batches. A world of two writes one: A on
rank 0, B on rank 1 (the ranks' mean).
Usage: bf16_sum_worker.py MODEL_DIR OUT_FILE
"""

import sys

import torch


def gradient(model_dir: str, micro_batches: list) -> torch.Tensor:
    """The flat fp32 gradient after backpropagating `micro_batches` (packed batches) in order."""
    from deepspeed.utils import safe_get_full_grad

    from vlrft.backends.deepspeed_backend import DeepSpeedBackend
    from vlrft.models.forward import policy_forward
    from vlrft.models.loader import load_model

    backend = DeepSpeedBackend(load_model(model_dir, compute_dtype="bfloat16"), lr=1e-3, weight_decay=0.0,
                               grad_clip=0.0, zero_stage=3, bf16_weights=True)
    for i, batch in enumerate(micro_batches):
        logp = policy_forward(backend.model, batch, 1.0).logp
        backend.backward(-(logp * batch.response_mask).sum(), boundary=i == len(micro_batches) - 1)
    assert all(p.dtype == torch.bfloat16 for p in backend.module.parameters())
    return torch.cat([safe_get_full_grad(p).double().flatten() for p in backend.module.parameters()])


def main(model_dir: str, out_file: str) -> None:
    from vlrft.distributed import init_distributed
    from vlrft.models.packing import pack
    from vlrft.types import Prompt, Rollout

    rank, world_size = init_distributed()
    g = torch.Generator().manual_seed(0)
    a, b = (pack([Rollout(Prompt(id=str(i), data_source="t", answer="", meta={}, prompt_text="",
                                 prompt_ids=torch.randint(10, 600, (12,), generator=g).tolist(), index=i),
                          i, torch.randint(10, 600, (6,), generator=g).tolist(), "", False)]) for i in range(2))
    if world_size == 1:
        out = {"a": gradient(model_dir, [a]), "a_thrice": gradient(model_dir, [a, a, a]),
               "a_then_b": gradient(model_dir, [a, b])}
    else:
        out = {"mean_of_ranks": gradient(model_dir, [(a, b)[rank]])}
    if rank == 0:
        torch.save(out, out_file)


if __name__ == "__main__":
    from vlrft.distributed import exit_process

    main(*sys.argv[1:])
    exit_process()  # interpreter finalisation can abort a finished rank (vlrft.distributed)
