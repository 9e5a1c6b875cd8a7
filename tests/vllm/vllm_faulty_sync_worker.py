"""Worker of test_partial_syncs_to_vllm_stop_the_run: the vLLM engine's update silently leaves
tensors out or rounds one (the partial syncs peers' users report); the exact sync check must
name them. The first fault goes through a real training step (it must stop at step 1), the
others through the check's own update with weights the engine does not serve yet. Each rank
writes {fault: message or ""} to OUT_DIR/rank<R>.json.
Usage: vllm_faulty_sync_worker.py OUT_DIR FAULT[,FAULT...] override [override ...]
FAULT: layer (decoder layer 1 left out), embedding (the embedding left out: the LM head too where
it is tied), lm_head (an untied LM head left out), rounded (one tensor stored through bfloat16),
lora (the LoRA-merged weights left out), none.
"""

import json
import sys
from pathlib import Path

import torch


def fault_filter(fault: str, lora_targets: list[str]):
    """(skip(name), round_to(name)) of a fault."""
    never = lambda name: False  # noqa: E731
    return {
        "layer": (lambda name: ".layers.1." in name, never),
        "embedding": (lambda name: "embed_tokens" in name, never),
        "lm_head": (lambda name: name == "lm_head.weight", never),
        "rounded": (never, lambda name: name.endswith("layers.0.mlp.down_proj.weight")),
        "lora": (lambda name: any(f".{target}." in name for target in lora_targets), never),
        "none": (never, never),
    }[fault]


def main(out_dir: str, faults: list[str], overrides: list[str]) -> None:
    from vlrft.config import load_config
    from vlrft.distributed import exit_process
    from vlrft.engines.weight_digest import WeightDigestError
    from vlrft.trainer.spmd_trainer import SPMDTrainer

    trainer = SPMDTrainer(load_config(None, overrides))
    healthy = trainer.engine.update_weights
    fault_now = {"name": faults[0]}

    def faulty(named_tensors):
        skip, round_to = fault_filter(fault_now["name"], trainer.cfg.model.lora.target_modules)
        healthy((name, tensor.to(torch.bfloat16).float() if round_to(name) else tensor)
                for name, tensor in named_tensors if not skip(name))

    trainer.engine.update_weights = faulty
    found = {}
    try:
        trainer.train_step()
        found[faults[0]] = ""
    except WeightDigestError as error:
        found[faults[0]] = str(error)
    for number, fault in enumerate(faults[1:], start=1):
        fault_now["name"] = "none"  # the policy served again, then new weights with this fault
        trainer.guards.digests.update(trainer.policy_weights(), "restoring")
        fault_now["name"] = fault
        moved = ((name, tensor + 0.01 * number) for name, tensor in trainer.policy_weights())
        try:
            trainer.guards.digests.update(moved, f"with fault {fault}")
            found[fault] = ""
        except WeightDigestError as error:
            found[fault] = str(error)
    Path(out_dir, f"rank{trainer.rank}.json").write_text(json.dumps(found))
    exit_process(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","), sys.argv[3:])
