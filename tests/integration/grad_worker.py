"""Worker of test_split_invariance: one optimizer step's gradient on a fixed batch of experiences.

Run under torchrun (any world size) or plain python (a world of one). Every rank builds the same
8 experiences from a seed, keeps its share, runs vlrft's policy_update on a DeepSpeed ZeRO-2
backend and, just before the optimizer step, records the full gradient. SHARE "strided" keeps
rank::world_size; "balanced" gives rank 0 all but the last experience (the last rank that one), then evens the tokens
out with trainer/rank_balance (which must move samples and lower the imbalance).
LORA_RANK > 0 trains LoRA adapters (random, seeded B, so every adapter has a gradient) and
records their gradient only. SEQUENCE_PARALLEL N in the environment: groups of N ranks share each
micro-batch (train.sequence_parallel), the model on sdpa_segments. PROMPTS "shared": each pair of experiences answers one prompt and
the micro-batches carry it once (train.share_prompts); "shared-off": the same pairs, unshared;
"distinct" (default): 8 prompts, unshared. CHUNK_TOKENS in the environment: the LM head's chunk
(models/chunked.py) made that small, so ranks make different numbers of head calls.
Every experience carries a teacher's top-4 tokens, so the loss has distillation's jsd term too.
Usage: grad_worker.py MODEL_DIR TRAIN_JSONL MICRO_BATCH_TOKENS OUT_FILE [SHARE [ZERO_STAGE [LORA_RANK [PROMPTS]]]]
"""

import os
import sys

import torch


def main(model_dir: str, train_path: str, micro_batch_tokens: int, out_file: str, share: str = "strided",
         zero_stage: str = "2", lora_rank: str = "0", prompts: str = "distinct") -> None:
    from deepspeed.utils import safe_get_full_grad

    from vlrft.algo import LOSS_AGG_MODES
    from vlrft.backends.deepspeed_backend import DeepSpeedBackend
    from vlrft.config import load_config
    from vlrft.data.dataset import load_rows
    from vlrft.data.encoding import PromptEncoder
    from vlrft.experience.replay_buffer import ReplayBuffer
    from vlrft.config import LORA_TARGETS
    from vlrft.models.loader import load_model
    from vlrft.models.lora import add_lora
    from vlrft.distributed import all_reduce_max_int, init_distributed, sequence_groups
    from vlrft.models.sdpa_segments import SDPA_SEGMENTS
    from vlrft.models.sequence_parallel import set_run_shard, shard_model
    from vlrft.models.ulysses import SequenceShard
    from vlrft.trainer.rank_balance import balance_across_ranks
    from vlrft.trainer.build import update_settings
    from vlrft.trainer.update import policy_update
    from vlrft.types import Experience, Rollout

    rank, world_size = init_distributed()
    # SEQUENCE_PARALLEL N: groups of N ranks share each micro-batch (train.sequence_parallel).
    sequence = int(os.environ.get("SEQUENCE_PARALLEL", "1"))
    shard = SequenceShard(*sequence_groups(sequence), sequence) if sequence > 1 else None
    set_run_shard(shard)
    if os.environ.get("CHUNK_TOKENS"):
        import vlrft.models.forward as forward

        moe_aux, keep_logits, _, top_ids = forward.policy_forward.__defaults__
        forward.policy_forward.__defaults__ = (moe_aux, keep_logits, int(os.environ["CHUNK_TOKENS"]), top_ids)
    encoder = PromptEncoder(model_dir, 3136, 12544, 1024)
    rows = load_rows(train_path)
    g = torch.Generator().manual_seed(0)
    experiences = []
    for i in range(8):  # different response lengths, one empty response
        prompt = encoder.encode(rows[i // 2 if prompts.startswith("shared") else i], i // 2)
        length = [0, 3, 7, 12, 5, 9, 2, 10][i]
        ids = torch.randint(10, 600, (length,), generator=g).tolist()
        rollout = Rollout(prompt=prompt, group_id=i // 2, response_ids=ids, response_text="", truncated=False)
        experiences.append(
            Experience(
                rollout=rollout,
                reward=0.0,
                reward_components={},
                # Off-policy old logprobs (ratio != 1, clipping active) and a reference for the KL.
                old_logprobs=-6.5 + 0.5 * torch.randn(length, generator=g),
                ref_logprobs=-6.5 + 0.5 * torch.randn(length, generator=g),
                advantages=torch.randn(length, generator=g),
                # A teacher's top-4 tokens and logprobs at each token (distillation's jsd term).
                teacher_topk_ids=torch.randint(10, 600, (length, 4), generator=g).int(),
                teacher_topk_logprobs=-2.0 + torch.randn(length, 4, generator=g),
            )
        )
    if share == "balanced":
        mine = experiences[:-1] if rank == 0 else experiences[-1:] if rank == world_size - 1 else []
        mine, balance = balance_across_ranks(mine, share_prompts=prompts == "shared")
        assert balance["perf/rank_imbalance"] < balance["perf/rank_imbalance_before"], balance
        print(f"rank {rank}: {len(mine)} samples after balancing, {balance}", flush=True)
    else:
        mine = experiences[rank::world_size]
    grads = {}
    for mode in LOSS_AGG_MODES:
        cfg = load_config(None, [
            f"model.path={model_dir}", f"data.train_path={train_path}", f"algo.loss_agg_mode={mode}",
            "algo.kl.coef=0.1", "algo.entropy_coef=0.01", "algo.dual_clip_c=3", "rollout.rollout_prompts=4",
            f"train.micro_batch_tokens={micro_batch_tokens}", "train.grad_clip=0", f"train.share_prompts={prompts == 'shared'}",
            f"teacher.path={model_dir}", "algo.distill.mode=jsd", "algo.distill.top_k=4", "algo.distill.coef=0.5",
            "algo.distill.beta=0.3",
        ])
        torch.manual_seed(0)
        model = load_model(model_dir, attention=SDPA_SEGMENTS if shard else "sdpa")
        shard_model(model, shard)
        if int(lora_rank) > 0:
            add_lora(model, int(lora_rank), 8.0, 0.0, LORA_TARGETS)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "lora_B" in name:
                        p.copy_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
        backend = DeepSpeedBackend(model, lr=1e-3, weight_decay=0.0, grad_clip=0.0, zero_stage=int(zero_stage))
        buffer = ReplayBuffer(micro_batch_tokens, seed=rank, share_prompts=cfg.train.share_prompts)
        buffer.add(mine)

        def record_then_step(step=backend.step):
            trained = [p for p in backend.module.parameters() if p.requires_grad]
            grads[mode] = torch.cat([safe_get_full_grad(p).flatten().clone() for p in trained])
            return step()

        backend.step = record_then_step
        if prompts == "shared":  # some micro-batch shares a prompt, some prompt is in two micro-batches
            batches = [b for mb in buffer.mini_batches(1, shuffle=False) for b in mb if not b.dummy]
            keys = [{s.rollout.prompt.index for s in b.samples} for b in batches]
            split = any(a & b for i, a in enumerate(keys) for b in keys[i + 1:])
            assert all_reduce_max_int(any(b.shares_prompts() for b in batches)) and all_reduce_max_int(split)
        policy_update(backend, buffer, update_settings(cfg), kl_coef=cfg.algo.kl.coef)
    if rank == 0:
        torch.save(grads, out_file)


if __name__ == "__main__":
    from vlrft.distributed import exit_process

    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), *sys.argv[4:])
    exit_process()  # interpreter finalisation can abort a finished rank (vlrft.distributed)
