"""Worker of test_bad_micro_batch_is_skipped_on_both_ranks: rank 1 holds a sample whose image
tokens do not match its pixels. Usage: skip_worker.py MODEL_DIR TRAIN_JSONL OUT_JSON"""

import json
import sys

import torch


def main(model_dir: str, train_path: str, out_file: str) -> None:
    from vlrft.backends.deepspeed_backend import DeepSpeedBackend
    from vlrft.config import load_config
    from vlrft.data.dataset import load_rows
    from vlrft.data.encoding import PromptEncoder
    from vlrft.experience.checks import ImageTokenCheck
    from vlrft.models.packing import pack
    from vlrft.experience.replay_buffer import ReplayBuffer
    from vlrft.models.loader import load_model
    from vlrft.distributed import init_distributed
    from vlrft.trainer.build import update_settings
    from vlrft.trainer.update import policy_update
    from vlrft.types import Experience, Rollout

    rank, world_size = init_distributed()
    encoder = PromptEncoder(model_dir, 3136, 12544, 1024)
    rows = load_rows(train_path)
    model = load_model(model_dir)
    check = ImageTokenCheck.for_model(model.config)
    experiences = []
    for i in range(2):
        prompt = encoder.encode(rows[2 * rank + i], 2 * rank + i)
        if rank == 1 and i == 0:  # one image token lost: the forward would fail on this rank only
            prompt.prompt_ids.remove(check.image_token_id)
            prompt.mm_token_types = prompt.mm_token_types[: len(prompt.prompt_ids)]
        rollout = Rollout(prompt=prompt, group_id=prompt.index, response_ids=[5, 6, 7], response_text="", truncated=False)
        experiences.append(Experience(rollout, 0.0, {}, old_logprobs=torch.full((3,), -6.0),
                                      advantages=torch.tensor([1.0, -1.0, 0.5])))
    cfg = load_config(None, [f"model.path={model_dir}", f"data.train_path={train_path}", "rollout.rollout_prompts=2",
                             "train.micro_batch_tokens=1"])  # one sample per micro-batch
    backend = DeepSpeedBackend(model, lr=1e-2, weight_decay=0.0, grad_clip=1.0, zero_stage=2)
    before = [p.detach().clone() for p in backend.module.parameters()]
    buffer = ReplayBuffer(1, seed=0)
    # One mini-batch in a fixed order: micro-batch 0 is bad on rank 1.
    buffer.mini_batches = lambda count, shuffle: [[pack([e]) for e in experiences]]
    metrics = policy_update(backend, buffer, update_settings(cfg), image_check=check)
    moved = any(not torch.equal(a, p) for a, p in zip(before, backend.module.parameters()))
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump({**metrics, "moved": moved}, f)


if __name__ == "__main__":
    from vlrft.distributed import exit_process

    main(sys.argv[1], sys.argv[2], sys.argv[3])
    exit_process()  # interpreter finalisation can abort a finished rank (vlrft.distributed)
