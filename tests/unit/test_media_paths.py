"""Media path containment (data/media.py): a row may name image and video files only inside its
data set's directory or `data.media_roots`; absolute paths, `..` and symlinks out are bad input
unless `data.allow_external_media`. Also: the difficulty filter's file names from row ids and
the bound on a video file's frame count."""

from __future__ import annotations

import json
import os
import sys
import time
import types
from pathlib import Path

import pytest
from PIL import Image

from data_tools.difficulty_filter import storable
from vlrft.config import ConfigError, load_config
from vlrft.data.columns import Columns
from vlrft.data.dataset import DataError, canonical_row, load_rows, read_rows
from vlrft.data.media import MediaPaths, media_from
from vlrft.data.video_file import MAX_SOURCE_FRAMES, decode_video_file
from vlrft.trainer.bad_input import BadInput

EXTERNAL = MediaPaths(allow_external=True)


@pytest.fixture
def tree(tmp_path):
    """data/ (the data set: images/in.png, a link to it, links out) and outside/secret.png."""
    data, outside = tmp_path / "data", tmp_path / "outside"
    (data / "images").mkdir(parents=True)
    outside.mkdir()
    Image.new("RGB", (8, 8), (200, 0, 0)).save(data / "images" / "in.png")
    Image.new("RGB", (8, 8), (0, 200, 0)).save(outside / "secret.png")
    os.symlink(data / "images" / "in.png", data / "images" / "alias.png")  # stays inside
    os.symlink(outside / "secret.png", data / "images" / "link_out.png")
    os.symlink(outside, data / "dir_out")
    return data, outside


def image_row(path: str, row_id: str = "q1") -> dict:
    return {"id": row_id, "answer": "red",
            "messages": [{"role": "user", "content": [{"type": "image", "image": path}, {"type": "text", "text": "?"}]}]}


def write_rows(data: Path, rows: list[dict]) -> Path:
    path = data / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ESCAPES = {  # form -> the path a row names, given the outside directory
    "absolute": lambda outside: str(outside / "secret.png"),
    "dot-dot": lambda outside: "../outside/secret.png",
    "symlink out": lambda outside: "images/link_out.png",
    "symlinked directory out": lambda outside: "dir_out/secret.png",
    "absolute system file": lambda outside: "/etc/hostname",
}


@pytest.mark.parametrize("form", ESCAPES)
def test_each_escaping_form_is_refused_naming_the_row_and_allowed_with_the_flag(form, tree):
    data, outside = tree
    named = ESCAPES[form](outside)
    path = write_rows(data, [image_row("images/in.png", "good"), image_row(named, "q1")])
    with pytest.raises(DataError, match=r"train.jsonl:2 \(row id 'q1'\): image path outside the data set's directory") as err:
        load_rows(path)
    assert named in str(err.value) and "\n" not in str(err.value)
    if form == "absolute system file" and not Path(named).is_file():
        return  # nothing to load with the flag on this machine
    rows = load_rows(path, media=EXTERNAL)
    assert Path(rows[1]["messages"][0]["content"][0]["image"]).resolve() == Path(named if named.startswith("/") else data / named).resolve()


def test_skip_counts_an_escaping_row(tree, capsys):
    data, outside = tree
    path = write_rows(data, [image_row("images/in.png", "good"), image_row(str(outside / "secret.png"), "bad")])
    rows, problems = read_rows(path, skip_bad=True)
    assert [r["id"] for r in rows] == ["good"] and len(problems) == 1 and "row id 'bad'" in problems[0]
    bad_input = BadInput("skip", 0, 1)
    assert len(bad_input.load(path)) == 1 and bad_input.skipped_rows == 1
    assert "skipping" in capsys.readouterr().out
    assert len(BadInput("skip", 0, 1, media=EXTERNAL).load(path)) == 2


def test_paths_that_stay_inside_are_fine(tree):
    data, _ = tree
    named = ["images/in.png", "images/alias.png", str(data / "images" / "in.png"), "images/../images/in.png"]
    rows = load_rows(write_rows(data, [image_row(p, f"r{i}") for i, p in enumerate(named)]))
    assert [Path(r["messages"][0]["content"][0]["image"]).resolve() for r in rows] == [(data / "images" / "in.png").resolve()] * 4


def test_a_media_root_allows_its_files(tree):
    data, outside = tree
    path = write_rows(data, [image_row("../outside/secret.png")])
    assert load_rows(path, media=MediaPaths(roots=(str(outside),)))[0]["id"] == "q1"
    with pytest.raises(DataError, match="outside"):  # a root allows its own files, not its neighbours'
        load_rows(path, media=MediaPaths(roots=(str(data / "images"),)))


def test_video_parts_and_mapped_columns_are_contained(tree):
    data, outside = tree
    secret = str(outside / "secret.png")
    frames = {"id": "v", "answer": "red", "messages": [{"role": "user", "content": [
        {"type": "video", "video": ["images/in.png", secret]}]}]}
    clip = {"id": "c", "answer": "red", "messages": [{"role": "user", "content": [{"type": "video", "video": secret}]}]}
    mapped = {"id": "m", "prompt": "<image> which colour?", "answer": "red", "images": ["../outside/secret.png"]}
    for row in (frames, clip, mapped):
        path = write_rows(data, [row])
        what = "image" if row is mapped else "video"
        with pytest.raises(DataError, match=f"row id '{row['id']}'\\): {what} path outside"):
            load_rows(path, Columns())
        assert load_rows(path, Columns(), EXTERNAL)[0]["id"] == row["id"]


def test_step_api_rows_are_contained_in_the_working_directory(tree, monkeypatch):
    data, outside = tree
    monkeypatch.chdir(data)
    assert canonical_row(image_row("images/in.png"), 0)["id"] == "q1"
    with pytest.raises(DataError, match=r"prompt:0 \(row id 'q1'\): image path outside"):
        canonical_row(image_row("../outside/secret.png"), 0)
    assert canonical_row(image_row("../outside/secret.png"), 0, media=EXTERNAL)["id"] == "q1"


def test_config_keys_change_what_loads(tree, monkeypatch):
    """`data.media_roots` (relative to where it is written) and `data.allow_external_media`, read
    through `media_from` as the trainer and the difficulty filter do."""
    data, outside = tree
    monkeypatch.chdir(data)  # the overrides' `../outside` is relative to the current directory
    path = write_rows(data, [image_row("../outside/secret.png")])
    config = data.parent / "configs" / "run.yaml"
    config.parent.mkdir()
    config.write_text(f"model: {{path: model}}\ndata: {{train_path: {path}}}\n")
    plain = load_config(config)
    assert media_from(plain.data) == MediaPaths()
    with pytest.raises(DataError, match="outside"):
        load_rows(path, media=media_from(plain.data))
    for overrides in (["data.media_roots=[../outside]"], ["data.allow_external_media=true"]):
        cfg = load_config(config, overrides)
        assert load_rows(path, media=media_from(cfg.data))[0]["id"] == "q1"
    assert load_config(config, ["data.media_roots=[../outside]"]).data.media_roots == [str(outside.resolve())]
    in_file = config.with_name("roots.yaml")  # in the file: relative to configs/
    in_file.write_text(f"model: {{path: model}}\ndata: {{train_path: {path}, media_roots: [../outside]}}\n")
    assert load_config(in_file).data.media_roots == [str(outside.resolve())]
    with pytest.raises(ConfigError, match="data.media_roots"):
        load_config(config, ["data.media_roots=['']"])


def test_row_ids_never_become_path_components(tmp_path):
    """The difficulty filter stores image bytes under out/images named from the row id."""
    import io

    png = io.BytesIO()
    Image.new("RGB", (4, 4)).save(png, format="PNG")
    out = tmp_path / "out"
    stored = []
    for row_id in ("../../escaped", "/tmp/abs", "a/b", "..", "plain-1"):
        row = {"id": row_id, "messages": [{"role": "user", "content": [{"type": "image", "image": png.getvalue()}]}]}
        stored.append(storable(row, out)["messages"][0]["content"][0]["image"])
    files = sorted(p for p in tmp_path.rglob("*") if p.is_file())
    assert len(set(stored)) == 5 and all((out / s).resolve().parent == (out / "images").resolve() for s in stored)
    assert files == sorted((out / s) for s in stored)  # nothing written anywhere else
    assert stored[-1].startswith("images/plain-1-")


def test_a_video_file_claiming_endless_frames_stops_at_the_bound(monkeypatch, tmp_path):
    """The counting pass reads frames until the file ends; a crafted one never does (and its
    header gives no frame count to refuse it by)."""
    class EndlessCapture:
        def __init__(self, path, backend):
            pass

        def isOpened(self):
            return True

        def get(self, prop):
            return {"fps": 30.0, "width": 64, "height": 48, "count": 0}[prop]

        def grab(self):
            return True

        def release(self):
            pass

    props = {"CAP_PROP_FPS": "fps", "CAP_PROP_FRAME_WIDTH": "width", "CAP_PROP_FRAME_HEIGHT": "height",
             "CAP_PROP_FRAME_COUNT": "count", "CAP_FFMPEG": 1900}
    monkeypatch.setitem(sys.modules, "cv2", types.SimpleNamespace(VideoCapture=EndlessCapture, **props))
    (tmp_path / "endless.mp4").write_bytes(b"not decoded by the double")
    start = time.perf_counter()
    with pytest.raises(ValueError, match=f"more than {MAX_SOURCE_FRAMES} frames of 64x48"):
        decode_video_file(str(tmp_path / "endless.mp4"), 2.0, 8)
    assert time.perf_counter() - start < 60
