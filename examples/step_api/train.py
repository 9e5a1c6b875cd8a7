"""Train on responses generated and scored outside vlrft: the Python step API.

Every rank builds the trainer from a config, then, each step, takes its prompts, gets a group
of responses per prompt from its own generator (here: the right sum and three wrong ones, as
an external sampler or a labelling pipeline would hand them over), scores them with its own
function, and calls `trainer.step(prompts, responses, scores)`: the same experience pass
(old and reference logprobs, group advantages), update and engine sync as `vlrft train`.

Run on 2 CPU ranks: bash examples/step_api/run.sh   (or torchrun --nproc_per_node 2 this file)
"""

import argparse
import json
import random
from pathlib import Path

from vlrft.config import load_config
from vlrft.data.dataset import load_rows
from vlrft.distributed import exit_process
from vlrft.trainer.spmd_trainer import SPMDTrainer

HERE = Path(__file__).resolve().parent


def my_responses(row: dict, rng: random.Random) -> list[str]:
    """Stands in for any generator outside vlrft: four candidate answers, the right one first."""
    right = int(row["answer"])
    wrong = rng.sample([n for n in range(10) if n != right], 3)
    return [f"<answer>{n}</answer>" for n in [right, *wrong]]


def my_score(response: str, row: dict) -> float:
    return 1.0 if response == f"<answer>{row['answer']}</answer>" else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(HERE / "../../artifacts/tiny-text"))
    parser.add_argument("--data", default=str(HERE / "../../artifacts/addition/train.jsonl"))
    parser.add_argument("--out", default=str(HERE / "../../runs/step_api"))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per rank per step")
    args = parser.parse_args()

    cfg = load_config(None, [
        f"model.path={args.model}", f"data.train_path={args.data}", f"output.dir={args.out}",
        "train.lr=0.002", "algo.kl.coef=0.01", f"train.total_steps={args.steps}",
    ])
    trainer = SPMDTrainer(cfg)
    rows = load_rows(args.data)[trainer.rank :: trainer.world_size][: args.prompts]  # this rank's prompts
    rng = random.Random(trainer.rank)
    responses = [my_responses(row, rng) for row in rows]
    scores = [[my_score(r, row) for r in group] for group, row in zip(responses, rows)]

    before = trainer.response_logprobs(rows, responses)
    for step in range(1, args.steps + 1):
        metrics = trainer.step(rows, responses, scores)
        if trainer.rank == 0:
            print(f"step {step}: reward {metrics['rollout/reward_mean']:.3f}, loss {metrics['train/loss']:.4f}")
    after = trainer.response_logprobs(rows, responses)

    # Per prompt: how much the right answer's logprob rose, and the wrong answers' on average
    # (they share the format tokens, so they may rise too, but less).
    right = [a[0] - b[0] for a, b in zip(after, before)]
    wrong = [sum(x - y for x, y in zip(a[1:], b[1:])) / (len(a) - 1) for a, b in zip(after, before)]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"logprob_change_rank{trainer.rank}.json").write_text(json.dumps({"right": right, "wrong": wrong}))
    print(f"rank {trainer.rank}: after {args.steps} steps the right answers' logprob changed by "
          f"{sum(right) / len(right):+.2f}, the wrong ones' by {sum(wrong) / len(wrong):+.2f} (mean per prompt)")


if __name__ == "__main__":
    main()
    exit_process()  # the process group goes first, then the process (without the interpreter's finalisation)
