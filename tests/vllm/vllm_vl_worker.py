"""Worker of test_vllm_vision_language: one experience pass of the tiny VL policy with the vLLM
engine (a world of one); prints the engine-vs-trainer logprob gap as JSON.
Usage: vllm_vl_worker.py MODEL_DIR TRAIN_JSONL OUT_DIR
"""

import json
import sys


def main(model_dir: str, train_path: str, out_dir: str) -> None:
    from vlrft.config import load_config
    from vlrft.trainer.spmd_trainer import SPMDTrainer

    cfg = load_config(None, [
        f"model.path={model_dir}", f"data.train_path={train_path}", "rollout.engine=vllm",
        "rollout.vllm_memory_fraction=0.1", "rollout.rollout_prompts=4", "rollout.n_samples_per_prompt=2",
        "rollout.max_new_tokens=8", "train.ppo_epochs=2", "reward.default=[{recipe: exact_match}]", f"output.dir={out_dir}",
    ])
    trainer = SPMDTrainer(cfg)
    prompts = [trainer.encoder.encode(trainer.train_rows[row], pos) for pos, row in trainer.sampler.next_indices()]
    experiences, metrics = trainer.maker.make(prompts)
    print(json.dumps({"samples": len(experiences), "images": sum(len(e.rollout.prompt.images) for e in experiences),
                      "max_diff": metrics["rollout/engine_logprob_diff_max"]}))


if __name__ == "__main__":
    main(*sys.argv[1:])
