"""Keep the rows a policy finds neither trivial nor hopeless: their pass rate lies in a band.

    python -m data_tools.difficulty_filter CONFIG OUT_DIR [--samples 8] [--low 0.1] [--high 0.9] [overrides...]

The run's own config says which policy (`model.path`), data (`data.train_path` and its column
mapping), sampling (`rollout.temperature`, `top_p`, `max_new_tokens`, `engine`) and correctness
(`reward.accuracy_recipe`) to use. Each row is answered `--samples` times; its pass rate is
the mean correctness. Written to OUT_DIR: `pass_rates.jsonl` (every row: id, pass rate,
kept) and `kept.jsonl` (the kept rows in the row schema; images given as bytes are stored
under `images/`), ready for `data.train_path`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
from pathlib import Path

from data_tools.convert import save_image


def in_band(pass_rates: list[float], low: float, high: float) -> list[bool]:
    """Which rows to keep: pass rate within [low, high]."""
    return [low <= rate <= high for rate in pass_rates]


def pass_rates(cfg, rows: list[dict], samples: int, batch_prompts: int = 8) -> list[float]:
    """Mean correctness of `samples` responses per row, by the config's engine and accuracy recipe."""
    from vlrft.data.encoding import PromptEncoder
    from vlrft.engines import ENGINES
    from vlrft.engines.base import SamplingParams
    from vlrft.experience.maker import completion_fields
    from vlrft.models.loader import banned_token_ids, stop_token_ids
    from vlrft.rewards.mix import RewardMix

    encoder = PromptEncoder.for_config(cfg)
    tokenizer = encoder.tokenizer
    engine = ENGINES.get(cfg.rollout.engine)(cfg, tokenizer, stop_token_ids(tokenizer), banned_token_ids(tokenizer))
    rewards = RewardMix(cfg.reward)
    params = SamplingParams(n=samples, max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature,
                            top_p=cfg.rollout.top_p, seed=cfg.train.seed)
    rates = []
    for start in range(0, len(rows), batch_prompts):
        prompts = [encoder.encode(row, start + i) for i, row in enumerate(rows[start : start + batch_prompts])]
        rollouts = engine.generate(prompts, params)
        correct = rewards.accuracy([r.response_text for r in rollouts], [completion_fields(r) for r in rollouts])
        by_prompt: dict[int, list[float]] = {}
        for rollout, ok in zip(rollouts, correct):
            by_prompt.setdefault(rollout.group_id, []).append(ok)
        rates += [sum(by_prompt[p.index]) / len(by_prompt[p.index]) for p in prompts]
        print(f"difficulty_filter: {start + len(prompts)}/{len(rows)} rows", flush=True)
    return rates


def file_stem(row_id) -> str:
    """A file name for a row's id: its safe characters (at most 64) and a hash of the whole id.
    An id is data: "../../x" or "/etc/x" must not place a file outside the output directory,
    and ids that differ only in unsafe characters must not share a file."""
    text = str(row_id)
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", text)[:64]
    return f"{safe}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def storable(row: dict, out: Path) -> dict:
    """The row with image bytes written to out/images (JSON holds paths, not bytes)."""
    messages = []
    for message in row["messages"]:
        content = message["content"]
        if not isinstance(content, str):
            content = [{**part, "image": save_image(part["image"], out, f"{file_stem(row['id'])}_{k}", row["id"])}
                       if part["type"] == "image" and isinstance(part["image"], bytes) else part
                       for k, part in enumerate(content)]
        messages.append({**message, "content": content})
    return {**row, "messages": messages}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--low", type=float, default=0.1)
    parser.add_argument("--high", type=float, default=0.9)
    parser.add_argument("overrides", nargs="*", help="config overrides, e.g. model.path=...")
    args = parser.parse_intermixed_args()

    from vlrft.config import load_config
    from vlrft.data.columns import columns_from
    from vlrft.data.dataset import load_rows
    from vlrft.data.media import media_from
    from vlrft.models.hub import resolve_model_paths

    cfg = load_config(args.config, args.overrides)
    resolve_model_paths(cfg)
    rows = load_rows(cfg.data.train_path, columns_from(cfg.data), media_from(cfg.data))
    rates = pass_rates(cfg, rows, args.samples)
    keep = in_band(rates, args.low, args.high)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "pass_rates.jsonl", "w", encoding="utf-8") as f:
        for row, rate, kept in zip(rows, rates, keep):
            f.write(json.dumps({"id": row["id"], "pass_rate": rate, "kept": kept}) + "\n")
    with open(args.out / "kept.jsonl", "w", encoding="utf-8") as f:
        for row, kept in zip(rows, keep):
            if kept:
                f.write(json.dumps(storable(row, args.out), ensure_ascii=False) + "\n")
    print(f"kept {sum(keep)} of {len(rows)} rows with pass rate in [{args.low}, {args.high}]: {args.out / 'kept.jsonl'}")


if __name__ == "__main__":
    main()
