"""Public data sets in their published form -> vlrft's JSONL row schema, images as files.

    python -m data_tools.convert gsm8k  train.parquet  out/gsm8k  --split train
    python -m data_tools.convert math   test.jsonl     out/math   --split test
    python -m data_tools.convert geo3k  train.parquet  out/geo3k  --split train
    python -m data_tools.convert clevr_count train.parquet out/clevr --split train
    python -m data_tools.convert scienceqa validation.parquet out/sqa --split validation

The input is a parquet file (as the hub serves these sets), a JSONL file or a JSON list.
Published forms read:
- gsm8k (openai/gsm8k): `question`, `answer` ending in `#### <number>`;
- math (hendrycks MATH, MATH-500): `problem`, `solution` with a final \\boxed{}, `level`,
  `type` (an `answer` column, as MATH-500 has, is used as it is);
- geo3k (hiyouga/geometry3k) and clevr_count (clevr_count_70k): `images` (HF Image
  feature), `problem` with `<image>` markers, `answer`;
- scienceqa (derek-thomas/ScienceQA): `image` (or null), `question`, `choices`, `answer`
  (the index of the right choice), `hint`, `subject`, `grade`.
Each row gets the `data_source` its reward recipe is mapped from (docs/datasets.md): math
sets `math_accuracy`, clevr_count `counting`, scienceqa `multiple_choice`.
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

from PIL import Image

from reward_recipes.answer_match import last_boxed
from vlrft.data.columns import IMAGE_MARKER, split_at_markers

BOXED = "Put the final answer in \\boxed{}."
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


class ConvertError(ValueError):
    """A row not in the data set's published form; names the row and the field."""


def read_any(path: Path) -> list[dict]:
    """The rows of a parquet, JSONL or JSON-list file, as stored."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json":
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def field(row: dict, name: str, where: str):
    if row.get(name) is None:
        raise ConvertError(f"{where}: no '{name}'")
    return row[name]


def user(content) -> list[dict]:
    return [{"role": "user", "content": content}]


def gsm8k_row(row: dict, where: str) -> dict:
    solution = field(row, "answer", where)
    if "####" not in solution:
        raise ConvertError(f"{where}: 'answer' has no '#### <number>' line")
    final = solution.rsplit("####", 1)[1].strip().replace(",", "")
    return {"messages": user(f"{field(row, 'question', where)}\n{BOXED}"), "answer": final, "data_source": "gsm8k",
            "meta": {"solution": solution}}


def math_row(row: dict, where: str) -> dict:
    answer = row.get("answer")
    if answer is None:
        answer = last_boxed(field(row, "solution", where))
        if answer is None:
            raise ConvertError(f"{where}: 'solution' has no \\boxed{{}} answer")
    meta = {k: row[k] for k in ("level", "type", "subject", "unique_id") if row.get(k) is not None}
    return {"messages": user(f"{field(row, 'problem', where)}\n{BOXED}"), "answer": str(answer), "data_source": "math",
            "meta": meta}


def save_image(cell, out: Path, name: str, where: str) -> str:
    """Write one HF Image cell ({"bytes", "path"} or bytes) under out/images; its relative path."""
    data = cell.get("bytes") if isinstance(cell, dict) else cell
    if not isinstance(data, (bytes, bytearray)) or not data:
        raise ConvertError(f"{where}: an image without bytes")
    try:
        with Image.open(io.BytesIO(data)) as image:
            suffix = (image.format or "png").lower().replace("jpeg", "jpg")
    except Exception as err:  # noqa: BLE001 - PIL raises several types for bad bytes
        raise ConvertError(f"{where}: unreadable image ({err})") from None
    relative = f"images/{name}.{suffix}"
    (out / "images").mkdir(parents=True, exist_ok=True)
    (out / relative).write_bytes(bytes(data))
    return relative


def image_problem_row(source: str, instruction: str):
    """Geo3K / CLEVR-count: `problem` with `<image>` markers, the images in order, `answer`."""

    def convert(row: dict, where: str, out: Path, name: str) -> dict:
        images = field(row, "images", where)
        images = images if isinstance(images, list) else [images]
        problem = field(row, "problem", where)
        markers = problem.count(IMAGE_MARKER)
        if markers > len(images):
            raise ConvertError(f"{where}: {markers} {IMAGE_MARKER} markers, {len(images)} images")
        paths = [save_image(cell, out, f"{name}_{k}", where) for k, cell in enumerate(images)]
        unmarked = [{"type": "image", "image": p} for p in paths[markers:]]  # images without a marker go first
        parts = unmarked + split_at_markers(problem, paths)
        parts.append({"type": "text", "text": instruction})
        return {"messages": user(parts), "answer": str(field(row, "answer", where)), "data_source": source, "meta": {}}

    return convert


def scienceqa_row(row: dict, where: str, out: Path, name: str) -> dict:
    choices = field(row, "choices", where)
    index = field(row, "answer", where)
    if not isinstance(index, int) or not 0 <= index < len(choices):
        raise ConvertError(f"{where}: 'answer' {index!r} is not an index into {len(choices)} choices")
    text = ""
    if row.get("hint"):
        text += f"Context: {row['hint']}\n"
    text += f"Question: {field(row, 'question', where)}\nOptions:\n"
    text += "".join(f"{LETTERS[k]}. {choice}\n" for k, choice in enumerate(choices))
    text += "Answer with the option's letter in \\boxed{}."
    parts = [{"type": "text", "text": text}]
    if row.get("image") is not None:
        parts.insert(0, {"type": "image", "image": save_image(row["image"], out, name, where)})
    meta = {k: row[k] for k in ("subject", "grade", "topic") if row.get(k) is not None}
    return {"messages": user(parts), "answer": LETTERS[index], "data_source": "scienceqa", "meta": meta}


TEXT_SETS = {"gsm8k": gsm8k_row, "math": math_row}
IMAGE_SETS = {
    "geo3k": image_problem_row("geo3k", BOXED),
    "clevr_count": image_problem_row("clevr_count", "Answer with the number in \\boxed{}."),
    "scienceqa": scienceqa_row,
}


def convert(name: str, source: Path, out: Path, split: str) -> Path:
    """Write out/<split>.jsonl (and out/images/) from `source`; the JSONL's path."""
    if name not in TEXT_SETS and name not in IMAGE_SETS:
        raise ConvertError(f"unknown data set '{name}'; known: {', '.join(sorted(TEXT_SETS | IMAGE_SETS))}")
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, row in enumerate(read_any(source)):
        where = f"{source}:{i}"
        row_id = f"{name}-{split}-{i:06d}"
        if name in TEXT_SETS:
            converted = TEXT_SETS[name](row, where)
        else:
            converted = IMAGE_SETS[name](row, where, out, row_id)
        lines.append(json.dumps({"id": row_id, **converted}, ensure_ascii=False))
    target = out / f"{split}.jsonl"
    target.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dataset", choices=sorted(TEXT_SETS | IMAGE_SETS))
    parser.add_argument("source", type=Path, help="the published file: parquet, JSONL or a JSON list")
    parser.add_argument("out", type=Path, help="output directory (SPLIT.jsonl and images/)")
    parser.add_argument("--split", default="train")
    args = parser.parse_args()
    try:
        path = convert(args.dataset, args.source, args.out, args.split)
    except ConvertError as err:
        raise SystemExit(f"data_tools.convert: error: {err}") from None
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
