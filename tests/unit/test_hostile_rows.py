"""A row is data from a stranger (data/row_fields.py): whatever its content, reading it either
gives a row of the schema's types or a bad row (a counted skip under `skip`, one line naming the
row under `error`), never an exception from deeper down: not Python's JSON reader (nesting,
digits), not the column mapping, not the trainer sorting data sources, not the chat template."""

from __future__ import annotations

import datetime
import json
import math
import random
import re

import pytest

from vlrft.data.dataset import DataError, canonical_row, load_rows, read_rows
from vlrft.data.row_fields import MAX_NESTING, ROLES

GOOD = {"id": "good", "messages": [{"role": "user", "content": "1+1?"}], "answer": "2", "data_source": "math"}


def text_row(**fields) -> dict:
    return {**GOOD, "id": "q", **fields}


def write_lines(path, lines) -> None:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))


def nested(depth: int):
    value = "x"
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("line, problem", [
    ("[" * 100_000 + "]" * 100_000, "invalid JSON (nested too deep to read)"),
    ('{"id": "q", "messages": [], "answer": ' + "1" * 5000 + "}",
     "invalid JSON (Exceeds the limit (4300 digits) for integer string conversion: value has 5000 digits)"),
])
def test_lines_pythons_json_reader_cannot_take_are_bad_lines(tmp_path, line, problem):
    path = tmp_path / "train.jsonl"
    write_lines(path, [GOOD, line])
    rows, problems = read_rows(path, skip_bad=True)
    assert [r["id"] for r in rows] == ["good"] and problems == [f"{path}:2: {problem}"]
    with pytest.raises(DataError, match=f"^{re.escape(f'{path}:2: {problem}')}$"):
        load_rows(path)


FIELD_CASES = {
    "data_source a number": (text_row(data_source=7),
                             "'data_source' must be a non-empty string without control characters, got int 7"),
    "data_source a list": (text_row(data_source=["a"]),
                           "'data_source' must be a non-empty string without control characters, got list"),
    "data_source empty": (text_row(data_source=""),
                          "'data_source' must be a non-empty string without control characters, got str ''"),
    "data_source a newline": (text_row(data_source="a\nb"),
                              "'data_source' must be a non-empty string without control characters, got str 'a\\nb'"),
    "id a list": (text_row(id=["q"]), "'id' must be a non-empty string or an integer, got list"),
    "id true": (text_row(id=True), "'id' must be a non-empty string or an integer, got bool"),
    "meta a list": (text_row(meta=[1]), "'meta' must be a JSON object, got list"),
    "answer null": (text_row(answer=None), "missing required field 'answer'"),
    "answer nested deep": (text_row(answer=nested(MAX_NESTING + 1)), f"nested more than {MAX_NESTING} deep"),
    "role a number": (text_row(messages=[{"role": 7, "content": "hi"}]),
                      "a message's 'role' must be one of system, user, assistant, tool, got int 7"),
    "role unknown": (text_row(messages=[{"role": "robot", "content": "hi"}]),
                     "a message's 'role' must be one of system, user, assistant, tool, got str 'robot'"),
    "text part without text": (text_row(messages=[{"role": "user", "content": [{"type": "text"}]}]),
                               "a text part needs 'text', a string, got NoneType"),
    "text part a number": (text_row(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]),
                           "a text part needs 'text', a string, got int 5"),
    "fps not a number": (text_row(messages=[{"role": "user", "content": [
        {"type": "video", "video": ["f.png"], "fps": math.nan}]}]), "a video part's 'fps' must be a positive number, got nan"),
    "mapped content a number": ({"id": "q", "prompt": [{"role": "user", "content": 5}], "answer": "a", "images": ["f.png"]},
                                "a message's content must be a string or a list of parts"),
}


@pytest.mark.parametrize("case", sorted(FIELD_CASES))
def test_a_field_of_the_wrong_type_is_a_bad_row(tmp_path, case):
    row, problem = FIELD_CASES[case]
    path = tmp_path / "train.jsonl"
    write_lines(path, [GOOD, row])
    where = f"{path}:2 (row id 'q')" if row.get("id") == "q" else f"{path}:2 (row id '?')"
    rows, problems = read_rows(path, skip_bad=True)
    assert [r["id"] for r in rows] == ["good"] and problems == [f"{where}: {problem}"]
    with pytest.raises(DataError, match=f"^{re.escape(f'{where}: {problem}')}$"):
        load_rows(path)


def test_rows_given_in_python_are_checked_alike():
    """The trainer's `step` API reads rows given in Python: types JSON cannot even hold."""
    with pytest.raises(DataError, match=r"^prompt:0 \(row id 'q'\): 'meta' holds a set, not JSON data$"):
        canonical_row(text_row(meta={"tags": {"a"}}), 0)
    with pytest.raises(DataError, match=r"^prompt:3 \(row id 'q'\): 'data_source' must be a non-empty string"):
        canonical_row(text_row(data_source=("a",)), 3)


def test_the_trainer_builds_from_rows_whose_data_source_was_not_a_string(tmp_path, tiny_text, world_of_one):
    from vlrft.config import load_config
    from vlrft.trainer.spmd_trainer import SPMDTrainer

    path = tmp_path / "train.jsonl"
    write_lines(path, [GOOD, text_row(id="n", data_source=7), text_row(id="l", data_source=["a"])])
    trainer = SPMDTrainer(load_config(None, [
        f"model.path={tiny_text}", f"data.train_path={path}", f"output.dir={tmp_path / 'run'}", "data.on_bad_sample=skip",
        "rollout.n_samples_per_prompt=2", "rollout.max_new_tokens=4", "eval.every_steps=0"]))
    assert trainer.train_sources == ["math"] and [r["id"] for r in trainer.train_rows] == ["good"]


def test_a_row_keeps_only_the_schemas_keys(tmp_path):
    (tmp_path / "f.png").write_bytes(b"read at encoding, not at load")
    row = {**GOOD, "secret": "x", "messages": [
        {"role": "user", "content": [{"type": "image", "image": "f.png", "image_url": "http://x"},
                                     {"type": "text", "text": "hi", "image": "f.png"}], "tool_calls": [{"x": 1}]}]}
    write_lines(tmp_path / "train.jsonl", [row])
    (read,) = load_rows(tmp_path / "train.jsonl")
    assert read == {"id": "good", "answer": "2", "data_source": "math", "meta": {}, "messages": [
        {"role": "user", "content": [{"type": "image", "image": str(tmp_path / "f.png")}, {"type": "text", "text": "hi"}]}]}


def test_a_meta_arrow_cannot_write_as_json_is_a_bad_row(tmp_path):
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet

    messages = [[{"role": "user", "content": "1+1?"}]] * 2
    table = pyarrow.table({"id": ["t", "n"], "messages": messages, "answer": ["2", "2"],
                           "meta": [{"at": datetime.datetime(2026, 1, 1)}, None]})
    pyarrow.parquet.write_table(table, tmp_path / "train.parquet")
    rows, problems = read_rows(tmp_path / "train.parquet", skip_bad=True)
    assert [r["id"] for r in rows] == ["n"] and rows[0]["meta"] == {}
    assert problems == [f"{tmp_path / 'train.parquet'}:0 (row id 't'): 'meta' holds a datetime, not JSON data"]


def random_value(rng: random.Random, depth: int = 0, python: bool = False):
    """A random JSON value (nesting up to 40 deep, past MAX_NESTING); with `python`, also
    values JSON cannot hold."""
    leaves = [None, True, 0, -7, 10**30, 1.5, math.nan, math.inf, "", "math", "a\nb", "user", "text", "image"]
    if python:
        leaves += [b"", b"\x89PNG", {"a"}, ("t",), object(), bytearray(b"x"), 2 + 3j]
    if depth < 40 and rng.random() < 0.45:
        if rng.random() < 0.5:
            return [random_value(rng, depth + 1, python) for _ in range(rng.randint(0, 3))]
        keys = ["role", "content", "type", "text", "image", "video", "fps", "id", "x"]
        return {rng.choice(keys): random_value(rng, depth + 1, python) for _ in range(rng.randint(0, 3))}
    return rng.choice(leaves)


def random_row(rng: random.Random, python: bool) -> dict:
    """GOOD with some of its fields (or its messages' pieces) replaced by random values."""
    row = json.loads(json.dumps(GOOD))
    for _ in range(rng.randint(1, 3)):
        target = rng.choice(["id", "answer", "data_source", "meta", "messages", "message", "content", "part", "prompt"])
        value = random_value(rng, python=python)
        if target == "message":
            row["messages"] = [value]
        elif target == "content":
            row["messages"] = [{"role": rng.choice(ROLES), "content": value}]
        elif target == "part":
            row["messages"] = [{"role": "user", "content": [value]}]
        elif target == "prompt":  # a row for the column mapping
            row = {"prompt": value, "answer": row["answer"], "images": random_value(rng, python=python)}
        else:
            row[target] = value
    return row


def assert_schema(row: dict) -> None:
    assert set(row) == {"id", "messages", "answer", "data_source", "meta"}
    assert isinstance(row["id"], (str, int)) and not isinstance(row["id"], bool)
    assert isinstance(row["data_source"], str) and row["data_source"].isprintable() and row["data_source"]
    assert isinstance(row["answer"], str) and isinstance(row["meta"], dict)
    json.dumps(row["meta"])
    for message in row["messages"]:
        assert set(message) == {"role", "content"} and message["role"] in ROLES
        if not isinstance(message["content"], str):
            for part in message["content"]:
                assert part["type"] in ("text", "image", "video")
                assert isinstance(part[part["type"]], (str, bytes, list))


def test_random_rows_are_read_or_refused_never_raised(tmp_path):
    """Two thousand random rows from a fixed seed, from a JSONL file and given in Python."""
    rng = random.Random(0)
    json_rows = [random_row(rng, python=False) for _ in range(1000)]
    path = tmp_path / "train.jsonl"
    write_lines(path, [GOOD, *(json.dumps(r, allow_nan=True) for r in json_rows)])
    rows, problems = read_rows(path, skip_bad=True)
    assert len(rows) + len(problems) == 1001 and problems and len(rows) > 1
    for row in rows:
        assert_schema(row)
    for number in range(1000):
        try:
            assert_schema(canonical_row(random_row(rng, python=True), number))
        except DataError as err:
            assert str(err).startswith(f"prompt:{number}") and "\n" not in str(err)


def test_a_chat_template_that_refuses_the_messages_makes_a_bad_prompt(tiny_text):
    from vlrft.data.encoding import PromptEncoder

    encoder = PromptEncoder(tiny_text, 3136, 12544, 512)
    encoder.tokenizer.chat_template = (  # as Qwen3's template does for messages without a user turn
        "{% if not messages | selectattr('role', 'equalto', 'user') | list %}"
        "{{ raise_exception('No user query found in messages.') }}{% endif %}{{ messages[0]['content'] }}")
    row = canonical_row(text_row(messages=[{"role": "system", "content": "be brief"}]), 0)
    with pytest.raises(DataError, match=r"^row id 'q': the chat template refuses its messages \(No user query found"):
        encoder.encode(row, 0)
