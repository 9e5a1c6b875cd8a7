"""data_tools.convert on hand-written rows in each data set's published form, and the
pass-rate filter (data_tools.difficulty_filter) on a hand-made case."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from data_tools.convert import ConvertError, convert
from data_tools.difficulty_filter import in_band
from vlrft.data.dataset import load_rows

ROOT = Path(__file__).parents[2]


def png(colour=(200, 30, 30), size=(40, 28)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return buffer.getvalue()


def parquet(rows: list[dict], path: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def user_text(row: dict) -> str:
    content = row["messages"][0]["content"]
    return content if isinstance(content, str) else "\n".join(p["text"] for p in content if p["type"] == "text")


def test_gsm8k(tmp_path):
    source = parquet([
        {"question": "Tom has 3 apples and buys 4 more. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
        {"question": "A car costs $1,200 more than $34. How much?", "answer": "1200+34=1234\n#### 1,234"},
    ], tmp_path / "gsm8k.parquet")
    rows = load_rows(convert("gsm8k", source, tmp_path / "out", "train"))
    assert [r["answer"] for r in rows] == ["7", "1234"]
    assert user_text(rows[0]) == "Tom has 3 apples and buys 4 more. How many?\nPut the final answer in \\boxed{}."
    assert rows[0]["data_source"] == "gsm8k" and rows[0]["id"] == "gsm8k-train-000000"


def test_math_from_the_solution_box_or_an_answer_column(tmp_path):
    source = tmp_path / "math.jsonl"
    source.write_text(
        json.dumps({"problem": "Half of 1?", "solution": "It is $\\boxed{\\frac{1}{2}}$.", "level": "Level 1",
                    "type": "Prealgebra"}) + "\n"
        + json.dumps({"problem": "2+2?", "solution": "Four.", "answer": "4", "subject": "Algebra"}) + "\n"
    )
    rows = load_rows(convert("math", source, tmp_path / "out", "test"))
    assert [r["answer"] for r in rows] == ["\\frac{1}{2}", "4"]
    assert rows[0]["meta"] == {"level": "Level 1", "type": "Prealgebra"} and rows[0]["data_source"] == "math"


@pytest.mark.parametrize("name, problem, answer", [
    ("geo3k", "<image>Find x. Round to the nearest tenth.", "3.5"),
    ("clevr_count", "<image>How many items are there in the image?", "3"),
])
def test_image_sets_store_their_images_and_encode(name, problem, answer, tmp_path, tiny_vl):
    from vlrft.data.encoding import PromptEncoder

    source = parquet([{"images": [{"bytes": png(), "path": None}], "problem": problem, "answer": answer}],
                     tmp_path / f"{name}.parquet")
    (row,) = load_rows(convert(name, source, tmp_path / "out", "train"))
    parts = row["messages"][0]["content"]
    assert parts[0]["type"] == "image" and Path(parts[0]["image"]).read_bytes() == png()
    assert parts[1] == {"type": "text", "text": problem.replace("<image>", "")}
    assert row["answer"] == answer and row["data_source"] == name
    prompt = PromptEncoder(tiny_vl, 3136, 12544, 1024).encode(row, 0)
    assert prompt.mm_inputs["image_grid_thw"].shape[0] == 1


def test_scienceqa_letters_context_and_optional_image(tmp_path):
    source = parquet([
        {"image": {"bytes": png(), "path": None}, "question": "Which is a mammal?", "choices": ["frog", "whale"],
         "answer": 1, "hint": "Look at the picture.", "subject": "natural science", "grade": "grade3"},
        {"image": None, "question": "Which word rhymes with cat?", "choices": ["hat", "dog", "sun"], "answer": 0,
         "hint": "", "subject": "language science", "grade": "grade1"},
    ], tmp_path / "sqa.parquet")
    rows = load_rows(convert("scienceqa", source, tmp_path / "out", "validation"))
    assert [r["answer"] for r in rows] == ["B", "A"]
    assert [p["type"] for p in rows[0]["messages"][0]["content"]] == ["image", "text"]
    assert user_text(rows[0]) == ("Context: Look at the picture.\nQuestion: Which is a mammal?\nOptions:\nA. frog\n"
                                  "B. whale\nAnswer with the option's letter in \\boxed{}.")
    assert [p["type"] for p in rows[1]["messages"][0]["content"]] == ["text"]
    assert rows[1]["meta"] == {"subject": "language science", "grade": "grade1"}


@pytest.mark.parametrize("name, row, problem", [
    ("gsm8k", {"question": "q", "answer": "no marker"}, "'answer' has no '#### <number>' line"),
    ("math", {"problem": "p", "solution": "no box"}, "'solution' has no \\boxed{} answer"),
    ("geo3k", {"images": [], "problem": "<image>x", "answer": "1"}, "1 <image> markers, 0 images"),
    ("scienceqa", {"question": "q", "choices": ["a"], "answer": 3}, "'answer' 3 is not an index into 1 choices"),
])
def test_a_row_not_in_the_published_form_is_named(name, row, problem, tmp_path):
    source = tmp_path / "bad.jsonl"
    source.write_text(json.dumps(row) + "\n")
    with pytest.raises(ConvertError) as err:
        convert(name, source, tmp_path / "out", "train")
    assert str(err.value) == f"{source}:0: {problem}"


def test_band_by_hand():
    assert in_band([0.0, 0.125, 0.5, 0.875, 1.0], 0.1, 0.9) == [False, True, True, True, False]


def test_the_filter_keeps_the_rows_in_the_band(tmp_path, tiny_text, addition_data):
    # Correctness by row, whatever the response: rows whose id ends in 0-4 always pass, the
    # others never; with the band [0.5, 1] exactly the first kind is kept.
    (tmp_path / "judge.py").write_text(
        "def by_id(completions, samples):\n    return [1.0 if s['id'][-1] in '01234' else 0.0 for s in samples]\n")
    rows = load_rows(addition_data / "train.jsonl")[:6]
    (tmp_path / "config.yaml").write_text(
        f"model: {{path: {tiny_text}}}\ndata: {{train_path: {addition_data / 'train.jsonl'}}}\n"
        f"rollout: {{max_new_tokens: 4}}\nreward: {{accuracy_recipe: '{tmp_path / 'judge.py'}:by_id'}}\n")
    small = tmp_path / "six.jsonl"
    small.write_text("".join(json.dumps(r) + "\n" for r in rows))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "data_tools.difficulty_filter", str(tmp_path / "config.yaml"), str(tmp_path / "out"),
           "--samples", "3", "--low", "0.5", "--high", "1.0", f"data.train_path={small}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rates = [json.loads(line) for line in (tmp_path / "out" / "pass_rates.jsonl").open()]
    expected = [1.0 if r["id"][-1] in "01234" else 0.0 for r in rows]
    assert [r["pass_rate"] for r in rates] == expected and [r["id"] for r in rates] == [r["id"] for r in rows]
    kept = load_rows(tmp_path / "out" / "kept.jsonl")
    assert [r["id"] for r in kept] == [r["id"] for r, e in zip(rows, expected) if e == 1.0]
    assert f"kept {len(kept)} of 6 rows" in proc.stdout
