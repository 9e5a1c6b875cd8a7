"""Worker of test_sequence_parallel: one packed micro-batch's logprobs, entropies, values and
parameter gradients with its tokens split over the ranks (train.sequence_parallel = world size),
against the same micro-batch run whole on each rank; and the policy's scores as a distillation
teacher (sampled-token logprobs, top-k ids and logprobs).

Every rank builds the same rollouts (seeded), packs them, runs them whole (the reference), then
sharded: the per-token outputs summed over the ranks and the gradients summed over the ranks
must equal the reference's. Writes each case's largest differences (relative to the largest
element for gradients) to OUT as JSON, from rank 0.
Usage (under torchrun): sequence_parallel_worker.py CASE[,CASE...] MODEL_DIR DATA_DIR OUT
CASE: text | vl | vl-shared | video | qwen3-vl (the mixed rollouts, shared, on a Qwen3-VL model) |
vl-checkpointed-frozen (gradient checkpointing on, the vision tower frozen: the rank that
encodes the images has no gradient into them, the other has its embeddings')
"""

import json
import sys
import tempfile
from pathlib import Path

import torch


def rollouts_of(case: str, model_dir: str, data_dir: str):
    from tests.conftest import make_mixed_rollouts
    from tests.unit.test_shared_prefix import groups_of
    from tests.unit.test_torch_varlen import text_rollouts

    if case == "vl-checkpointed-frozen":
        return make_mixed_rollouts(model_dir, Path(data_dir), Path(tempfile.mkdtemp()))[:2], False  # text, one image
    if case == "text":
        return text_rollouts(model_dir, Path(data_dir)), False
    if case == "video":
        from PIL import Image

        from tests.unit.test_model_families import video_rollouts

        root = Path(tempfile.mkdtemp())
        frames = []
        for i in range(5):
            Image.new("RGB", (64, 48), (40 * i, 200 - 30 * i, 90 + 20 * i)).save(root / f"f{i}.png")
            frames.append(str(root / f"f{i}.png"))
        return video_rollouts(model_dir, frames, root)[1], False
    mixed = make_mixed_rollouts(model_dir, Path(data_dir), Path(tempfile.mkdtemp()))
    return (groups_of(mixed, 3), True) if case in ("vl-shared", "qwen3-vl") else (mixed, False)


def run(policy, critic, batch, weights):
    """Per-token logprobs, entropies and values [1, T], and the gradients of their weighted sum."""
    from vlrft.models.forward import policy_forward
    from vlrft.models.value_model import token_values

    for model in (policy, critic):
        model.zero_grad(set_to_none=True)
    out = policy_forward(policy, batch, 0.7)
    values = token_values(critic, batch)
    ((out.logp * weights[0]).sum() + (out.entropy * weights[1]).sum()).backward()  # one model at a time, as an update
    (values * weights[2]).sum().backward()
    grads = torch.cat([p.grad.flatten() for m in (policy, critic) for p in m.parameters() if p.grad is not None])
    return [t.detach() for t in (out.logp, out.entropy, values)], grads


def compare(case: str, model_dir: str, data_dir: str, group) -> dict:
    """One case: the micro-batch run whole on each rank, then shared by the ranks of `group`."""
    from vlrft.distributed import all_reduce_sum, rank, sum_over, world_size
    from vlrft.models.loader import enable_gradient_checkpointing, freeze_vision_tower, load_model
    from vlrft.models.forward import teacher_scores
    from vlrft.models.packing import pack
    from vlrft.models.sdpa_segments import SDPA_SEGMENTS
    from vlrft.models.sequence_parallel import shard_model
    from vlrft.models.ulysses import SequenceShard
    from vlrft.models.value_model import ValueModel

    torch.manual_seed(0)
    policy = load_model(model_dir, attention=SDPA_SEGMENTS)
    critic = ValueModel(load_model(model_dir, attention=SDPA_SEGMENTS))
    torch.nn.init.normal_(critic.value_head.weight, std=0.1)  # (zero at init: no gradient below it)
    if case == "vl-checkpointed-frozen":
        for model in (policy, critic.backbone):
            freeze_vision_tower(model)
        assert enable_gradient_checkpointing(policy) > 0 and enable_gradient_checkpointing(critic.backbone) > 0
    rollouts, share = rollouts_of(case, model_dir, data_dir)
    batch = pack(rollouts, share=share)
    g = torch.Generator().manual_seed(1)
    weights = torch.rand(3, *batch.input_ids.shape, generator=g)
    whole, whole_grads = run(policy, critic, batch, weights)
    whole_teacher = teacher_scores(policy, batch, 0.7, top_k=4)  # the policy as a distillation teacher (jsd's top-k)

    shard = SequenceShard(group, rank(), world_size())
    for model in (policy, critic):
        shard_model(model, shard)
    parts, part_grads = run(policy, critic, batch, weights)
    summed = [sum_over(t, group) for t in parts]
    grads = all_reduce_sum(part_grads)
    teacher = teacher_scores(policy, batch, 0.7, top_k=4)
    teacher = [sum_over(t, group) for t in (teacher.logp, teacher.top_ids, teacher.top_logp)]
    return {
        # the teacher's logprobs, how many of its top-k ids differ, their logprobs
        "teacher": [float((teacher[0] - whole_teacher.logp).abs().max()), float((teacher[1] != whole_teacher.top_ids).sum()),
                    float((teacher[2] - whole_teacher.top_logp).abs().max())],
        "tokens": batch.input_ids.shape[1],
        "scored_here": int((parts[0] != 0).sum()),
        "scored": int((whole[0] != 0).sum()),
        "outputs": [float((a - b).abs().max()) for a, b in zip(summed, whole)],
        "gradient": float((grads - whole_grads).abs().max() / whole_grads.abs().max()),
        "gradient_elements": int(whole_grads.numel()),
    }


def main(cases: str, model_dir: str, data_dir: str, out_file: str) -> None:
    """`cases`: comma-separated, run one after the other in this launch."""
    from vlrft.distributed import init_distributed, new_groups, rank, world_size

    init_distributed()
    group = new_groups([list(range(world_size()))])[0]
    results = {case: compare(case, model_dir, data_dir, group) for case in cases.split(",")}
    if rank() == 0:
        Path(out_file).write_text(json.dumps(results))


if __name__ == "__main__":
    main(*sys.argv[1:])
