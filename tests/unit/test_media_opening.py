"""Media files are read where they were checked (data/media.py, data/beneath.py): a file swapped
for a symlink after load is refused at open, and nothing from outside reaches trajectories/ or
the report; paths the system cannot take (a NUL byte, 5,000 characters) are bad rows, counted
under `skip` and one line under `error`. Video files: test_video_budget.py; a bad prompt once
per run: test_bad_prompt_once.py."""

from __future__ import annotations

import base64
import json
import os
import threading
from pathlib import Path

import pytest
from PIL import Image

from vlrft.config import load_config
from vlrft.data.dataset import DataError, load_rows
from vlrft.data.encoding import PromptEncoder
from vlrft.data.media import MediaPaths
from vlrft.trainer.bad_input import BadInput
from vlrft.trajectory.report import image_data_uri, run_file, write_report

RED, GREEN = (200, 0, 0), (0, 200, 0)  # inside the data set; the outside file a swap points at


def image_row(path: str, row_id: str = "q1") -> dict:
    return {"id": row_id, "answer": "red", "data_source": "d", "meta": {},
            "messages": [{"role": "user", "content": [{"type": "image", "image": path}, {"type": "text", "text": "colour?"}]}]}


def write_rows(data: Path, rows: list[dict]) -> Path:
    path = data / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def tree(tmp_path):
    """data/images/in.png (red) and outside/secret.png (green)."""
    data, outside = tmp_path / "data", tmp_path / "outside"
    (data / "images").mkdir(parents=True)
    outside.mkdir()
    Image.new("RGB", (56, 56), RED).save(data / "images" / "in.png")
    Image.new("RGB", (56, 56), GREEN).save(outside / "secret.png")
    return data, outside


@pytest.fixture(params=["openat2", "openat walk"])
def opener(request, monkeypatch):
    """Both ways of opening beneath a root: the kernel's openat2, and the walk used without it."""
    from vlrft.data import beneath

    if request.param == "openat2" and not beneath.openat2_usable():
        pytest.skip("this kernel has no openat2")
    monkeypatch.setitem(beneath._openat2_state, "usable", request.param == "openat2")
    return request.param


def swap_for_link(path: Path, target: Path) -> None:
    path.unlink()
    os.symlink(target, path)


# ---- the opener --------------------------------------------------------------------------------

def test_open_beneath_reads_inside_and_refuses_links_escapes_and_fifos(tree, opener):
    from vlrft.data import beneath

    data, outside = tree
    os.symlink(outside / "secret.png", data / "link_out.png")
    os.symlink(data / "images" / "in.png", data / "link_in.png")  # a link, even to a file inside
    os.symlink(outside, data / "dir_out")
    os.mkfifo(data / "fifo")
    fd = beneath.open_beneath(str(data), "images/in.png")
    with os.fdopen(fd, "rb") as f:
        assert Image.open(f).getpixel((0, 0)) == RED
    refused = {"link_out.png": 40, "link_in.png": 40, "dir_out/secret.png": 40, "../outside/secret.png": 18,
               str(outside / "secret.png"): 18, "fifo": 22, "images": 22, "missing.png": 2}
    for relative, code in refused.items():  # ELOOP, EXDEV, EINVAL (not a regular file), ENOENT
        with pytest.raises(OSError) as err:
            beneath.open_beneath(str(data), relative)
        assert err.value.errno == code, (relative, err.value)
    with pytest.raises(ValueError, match="null byte"):
        beneath.open_beneath(str(data), "images/in.png\0.txt")
    assert beneath.openat2_usable() == (opener == "openat2")  # the walk really ran where asked


def test_a_fifo_swapped_in_does_not_hang_the_open(tree, opener):
    from vlrft.data.media import open_media

    data, _ = tree
    rows = load_rows(write_rows(data, [image_row("images/in.png")]))
    (data / "images" / "in.png").unlink()
    os.mkfifo(data / "images" / "in.png")
    outcome = []
    image = rows[0]["messages"][0]["content"][0]["image"]
    reader = threading.Thread(target=lambda: outcome.append(pytest.raises(OSError, open_media, image)), daemon=True)
    reader.start()  # a daemon: were the open to block, the test fails instead of hanging the session
    reader.join(timeout=60)
    assert not reader.is_alive() and outcome


# ---- a file swapped after load --------------------------------------------------------------

@pytest.mark.parametrize("swap", ["file", "directory"])
def test_a_symlink_swapped_in_after_load_is_refused_at_open(swap, tree, tiny_vl):
    data, outside = tree
    row = load_rows(write_rows(data, [image_row("images/in.png")]))[0]
    encoder = PromptEncoder(tiny_vl, 56 * 56, 112 * 112, 512)
    assert encoder.encode(row, 0).images[0].getpixel((0, 0)) == RED
    if swap == "file":
        swap_for_link(data / "images" / "in.png", outside / "secret.png")
    else:  # the directory on the way becomes a link to the outside, holding an in.png of its own
        (data / "images").rename(data / "old")
        (outside / "in.png").write_bytes((outside / "secret.png").read_bytes())
        os.symlink(outside, data / "images")
    with pytest.raises(DataError, match=r"^row id 'q1': cannot read image .*in\.png \(.*symbolic link.*\)$"):
        encoder.encode(row, 0)


def test_allow_external_media_still_refuses_a_link_swapped_in(tree, tiny_vl):
    """With the flag the root is "/": any file may be named, but the one opened is the one
    resolved at load; a link put on its path since is refused, a regular file written there is read."""
    data, outside = tree
    row = load_rows(write_rows(data, [image_row(str(outside / "secret.png"))]), media=MediaPaths(allow_external=True))[0]
    encoder = PromptEncoder(tiny_vl, 56 * 56, 112 * 112, 512)
    assert encoder.encode(row, 0).images[0].getpixel((0, 0)) == GREEN
    swap_for_link(outside / "secret.png", data / "images" / "in.png")
    with pytest.raises(DataError, match="symbolic link"):
        encoder.encode(row, 0)
    (outside / "secret.png").unlink()
    Image.new("RGB", (56, 56), RED).save(outside / "secret.png")
    assert encoder.encode(row, 0).images[0].getpixel((0, 0)) == RED


def secret_pixels_in(directory: Path) -> list[Path]:
    """The PNG files under `directory` whose first pixel is the outside file's green."""
    return [p for p in directory.rglob("*.png") if Image.open(p).convert("RGB").getpixel((0, 0)) == GREEN]


def test_a_swapped_file_reaches_neither_trajectories_nor_the_report(tree, tiny_vl, world_of_one, tmp_path, capsys):
    from vlrft.trainer.spmd_trainer import SPMDTrainer

    data, outside = tree
    Image.new("RGB", (56, 56), RED).save(data / "images" / "swapped.png")
    train = write_rows(data, [image_row("images/in.png", "good"), image_row("images/swapped.png", "swapped")])
    run = tmp_path / "run"
    trainer = SPMDTrainer(load_config(None, [
        f"model.path={tiny_vl}", f"data.train_path={train}", f"output.dir={run}", "rollout.n_samples_per_prompt=2",
        "rollout.max_new_tokens=2", "eval.every_steps=0", "rollout.rollout_prompts=2", "data.on_bad_sample=skip",
        "trajectory.save_every=1", "train.total_steps=1"]))
    swap_for_link(data / "images" / "swapped.png", outside / "secret.png")
    metrics = trainer.train_step()
    assert metrics["data/skipped_prompts"] == 1
    assert "vlrft: skipping row id 'swapped': cannot read image" in capsys.readouterr().out
    assert list((run / "trajectories" / "images").glob("*.png")) and not secret_pixels_in(run)
    report = write_report(run)[0].read_text()
    secret = base64.b64encode((outside / "secret.png").read_bytes()).decode()
    assert "data:image/png;base64," in report and secret not in report


def test_the_report_does_not_follow_a_link_put_in_after_its_check(tmp_path, opener):
    trajectories = tmp_path / "run" / "trajectories"
    (trajectories / "images").mkdir(parents=True)
    Image.new("RGB", (4, 4), RED).save(trajectories / "images" / "a.png")
    Image.new("RGB", (4, 4), GREEN).save(tmp_path / "secret.png")
    checked = run_file(trajectories, "images/a.png")
    assert checked is not None and image_data_uri(checked, {}).startswith("data:image/png;base64,")
    swap_for_link(trajectories / "images" / "a.png", tmp_path / "secret.png")
    assert image_data_uri(checked, {}) is None
    assert run_file(trajectories, "images/a.png") is None  # checked again: a link out
    for unusable in ("images/\0.png", "x" * 5000):  # shown as not shown or not found, never a traceback
        checked = run_file(trajectories, unusable)
        assert checked is None or image_data_uri(checked, {}) is None


# ---- paths the system cannot take -----------------------------------------------------------

UNUSABLE = {"NUL byte": "images/in\0.png", "5,000 characters": "images/" + "x" * 5000 + ".png"}


def unusable_rows(named: str) -> list[dict]:
    """One good row, then the path as an image, a video file, a video frame and a mapped column."""
    video = {"id": "video", "answer": "a", "messages": [{"role": "user", "content": [{"type": "video", "video": named}]}]}
    frames = {"id": "frames", "answer": "a", "messages": [{"role": "user", "content": [
        {"type": "video", "video": ["images/in.png", named]}]}]}
    mapped = {"id": "mapped", "prompt": "<image> colour?", "answer": "red", "images": [named]}
    return [image_row("images/in.png", "good"), image_row(named, "image"), video, frames, mapped]


@pytest.mark.parametrize("external", [False, True], ids=["contained", "allow_external_media"])
@pytest.mark.parametrize("kind", UNUSABLE)
def test_unusable_paths_are_counted_skips_and_one_line_errors(kind, external, tree, capsys):
    data, _ = tree
    media = MediaPaths(allow_external=external)
    path = write_rows(data, unusable_rows(UNUSABLE[kind]))
    with pytest.raises(DataError) as err:
        load_rows(path, media=media)
    message = str(err.value)
    assert message.startswith(f"{path}:2 (row id 'image'): unusable image path ") and "\n" not in message
    assert "\0" not in message and len(message) < 500, message
    bad_input = BadInput("skip", 0, 1, media=media)
    assert [row["id"] for row in bad_input.load(path)] == ["good"] and bad_input.skipped_rows == 4
    out = capsys.readouterr().out
    assert f"vlrft: skipped 4 bad rows of {path} (on_bad_sample: skip)\n" in out
    assert all(f"(row id '{row_id}'): unusable" in out for row_id in ("image", "video", "frames", "mapped"))
