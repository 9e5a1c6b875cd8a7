"""The offline trajectory report: loading, JSON numbers by hand, a self-contained and escaped
page, the SVG helpers on degenerate input, and the CLI's one-line errors."""

from __future__ import annotations

import json
import re
from pathlib import Path
import xml.etree.ElementTree as ET

import pytest
from PIL import Image

from tests.report_fixtures import ALERT, ALERT_PEAK_ENTROPY, write_fake_run
from vlrft.cli import main
from vlrft.trajectory.records import ReportError, load_metrics, load_records
from vlrft.trajectory.report import write_report
from vlrft.trajectory.svg import histogram, line_chart

SECTION_IDS = ("overview", "curves", "histograms", "per-source", "samples")


@pytest.fixture()
def run_dir(tmp_path):
    return write_fake_run(tmp_path / "run")


def test_load_records_merges_ranks_by_step(run_dir):
    by_step = load_records(run_dir)
    assert list(by_step) == [10, 20]
    assert [r["rank"] for r in by_step[10]] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert len(by_step[20]) == 4
    # A null component is "not applicable": left out, not read as 0.
    assert "format" not in by_step[10][2]["components"]
    assert [m["step"] for m in load_metrics(run_dir)] == [10, 10, 20, 20]


def test_report_json_numbers_by_hand(run_dir):
    html_path, json_path = write_report(run_dir)
    assert (html_path, json_path) == (run_dir / "report.html", run_dir / "report.json")
    summary = json.loads(json_path.read_text())
    step10, step20, overall = summary["steps"]["10"], summary["steps"]["20"], summary["overall"]
    assert step10["source/colours/accuracy"] == pytest.approx(2 / 4)  # correct 1, 0, 0, 1
    assert step10["source/maths/accuracy"] == pytest.approx(1 / 4)  # correct 0, 0, 1, 0
    assert step20["source/colours/accuracy"] == 1.0 and step20["source/maths/accuracy"] == 0.5
    assert step10["zero_variance_group_frac"] == pytest.approx(1 / 4)  # g1 maths [0.5, 0.5]
    assert step20["zero_variance_group_frac"] == 0.0
    # Over the run a group is (step, group id): 1 equal group of 6. Bare ids would merge step
    # 10's g1 [0.5, 0.5] with step 20's g1 [0.0, 1.0] and report 0.
    assert overall["zero_variance_group_frac"] == pytest.approx(1 / 6)
    assert step10["reward/mean"] == pytest.approx((1 + 0 + 0.5 + 0.5 + 0.25 + 1 + 1 + 0) / 8)
    assert step10["component/format/mean"] == 0.5  # colours only; maths' null format is not applicable
    assert step10["truncated_frac"] == pytest.approx(2 / 8)
    assert overall["source/colours/accuracy"] == pytest.approx(4 / 6)
    assert overall["source/maths/accuracy"] == pytest.approx(2 / 6)
    assert summary["metrics"] == {"eval/accuracy": 0.5, "rollout/reward_mean": 0.6875, "train/kl": 0.02}


def test_html_is_self_contained_with_every_section(run_dir):
    html_path, _ = write_report(run_dir)
    page = html_path.read_text()
    for section in SECTION_IDS:
        assert re.search(rf'<section id="{section}"><h2>', page), section
    links = re.findall(r'\b(?:src|href)\s*=\s*["\']?([^"\'\s>]*)', page)
    assert links and not [link for link in links if re.match(r"(https?:)?//", link)]
    assert not re.search(r"<link[^>]+stylesheet|<script[^>]+src|@import|url\(", page)
    images = re.findall(r'<img src="([^"]+)"', page)
    assert images and all(src.startswith("data:image/png;base64,") for src in images)
    # Nothing refers back to the run directory's files, so the page survives a move.
    assert "trajectories/images" not in re.sub(r'(alt|title)="[^"]*"', "", page)


def test_completion_markup_is_shown_as_text(run_dir):
    page = write_report(run_dir)[0].read_text()
    assert ALERT not in page
    assert page.count("<script") == 1  # the page's own filter script, nothing from the data
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page  # the prompt, escaped whole
    # The response token by token: each token escaped, the step's highest-entropy one highlighted.
    assert (f'<span title="entropy 0.2">&lt;script&gt;</span><span class="hot" title="entropy {ALERT_PEAK_ENTROPY:g}">'
            f'alert(1)</span><span title="entropy 0.3">&lt;/script&gt;</span>') in page


def test_samples_are_best_and_worst_per_step_and_source(run_dir):
    page = write_report(run_dir, top_k=1)[0].read_text()
    # 2 steps x 2 sources x (best 1 + worst 1)
    assert len(re.findall(r'<div class="card (?:best|worst)"', page)) == 8
    assert 'data-step="20" data-source="maths"' in page


def test_a_large_step_still_gives_only_best_and_worst_cards(run_dir):
    big = [json.loads(line) for line in (run_dir / "trajectories/step_000020.rank1.jsonl").read_text().splitlines()]
    lines = [json.dumps(big[1] | {"group_id": i // 8, "reward": i / 3000}) + "\n" for i in range(3000)]
    (run_dir / "trajectories/step_000030.rank0.jsonl").write_text("".join(lines))
    page = write_report(run_dir)[0].read_text()
    step30 = page[page.index('data-step="30"'):]
    assert len(re.findall(r'<div class="card (?:best|worst)"', step30)) == 6  # one source, 3 + 3
    assert "reward 0.9997<" in step30 and "reward 0<" in step30 and "reward 0.5<" not in step30


def test_out_path_puts_the_json_next_to_the_html(run_dir, tmp_path):
    html_path, json_path = write_report(run_dir, tmp_path / "out" / "r.html")
    assert html_path.is_file() and json_path == tmp_path / "out" / "r.json" and json_path.is_file()


def test_malformed_line_names_file_and_line(run_dir):
    path = run_dir / "trajectories/step_000020.rank0.jsonl"
    path.write_text(path.read_text() + "\n{not json\n")  # line 3 blank, line 4 broken
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:4: malformed JSON line"):
        load_records(run_dir)
    path.write_text('{"id": "x"}\n')
    with pytest.raises(ReportError, match=rf"{re.escape(str(path))}:1: record lacks data_source, group_id"):
        load_records(run_dir)


def test_cli_writes_both_files_and_prints_their_paths(run_dir, capsys):
    assert main(["report", str(run_dir), "--top-k", "2"]) == 0
    assert capsys.readouterr().out.splitlines() == [str(run_dir / "report.html"), str(run_dir / "report.json")]


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_cli_missing_run_or_trajectories_is_one_line_exit_2(tmp_path, capsys, make):
    target = tmp_path / "run"
    if make == "empty":
        (target / "trajectories").mkdir(parents=True)
    assert main(["report", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("vlrft: error: ")
    assert ("does not exist" if make == "missing" else "no trajectories") in err


def parsed(svg: str) -> ET.Element:
    assert "nan" not in svg and "inf" not in svg
    return ET.fromstring(svg)  # well-formed: every tag closed, every text escaped


def bar_counts(chart: ET.Element) -> list[int]:
    """The counts in the bars' tooltips ("[lo, hi]: count"), left to right."""
    tooltips = [rect.find("title") for rect in chart.findall("rect")]
    return [int(title.text.rsplit(": ", 1)[1]) for title in tooltips if title is not None]


def test_svg_helpers_on_empty_and_degenerate_input():
    assert "no data" in line_chart({}, "t", "x", "y") and "no data" in line_chart({"a": []}, "t", "x", "y")
    assert "no data" in histogram([], 10, "t", "x") and "no data" in histogram([float("nan")], 10, "t", "x")
    single = parsed(line_chart({"only": [(5, 0.25)]}, "one point", "step", "v"))
    assert len(single.findall("circle")) == 1
    constant = parsed(line_chart({"flat": [(1, 0.0), (2, 0.0), (3, 0.0)]}, "flat", "step", "v"))
    assert len(constant.findall("polyline")) == 1
    assert sorted(bar_counts(parsed(histogram([3.0, 3.0, 3.0], 5, "constant", "x")))) == [0, 0, 0, 0, 3]
    assert "<b>" not in line_chart({"<b>": [(0, 1)]}, "<i>", "<x>", "<y>")


def test_histogram_counts_and_tick_numbers():
    chart = parsed(histogram([0, 1, 1, 2, 2, 2, 3, 3, 3, 3], 4, "h", "x"))
    assert bar_counts(chart) == [1, 2, 3, 4]
    labels = {t.text for t in chart.findall("text")}
    assert {"0", "1", "2", "3", "4"} <= labels and {"h", "x", "count"} <= labels
    lines = parsed(line_chart({"a": [(0, 0), (10, 1)], "b": [(0, 1), (10, 0)]}, "two", "step", "v"))
    assert {"a", "b"} <= {t.text for t in lines.findall("text")}  # the legend


def test_multi_turn_records_show_turns_and_observations(tmp_path):
    """A multi-turn record: its observation tokens are marked and never counted as entropy
    (their 9.0 would be the step's peak), and its card names the turns and their failures."""
    import json

    from tests.report_fixtures import record

    tokens = ["<tool_call>", "17*23", "</tool_call>", "<|im_end|>", "\n<|im_start|>tool\n", "391", "<answer>391</answer>"]
    multi = record(1, 0, 0, "maths", 1.0, 1, "<answer>391</answer>", [], tokens, [0.5, 0.6, 0.1, 0.2, 9.0, 9.0, 0.3])
    multi |= {"trained": [1, 1, 1, 1, 0, 0, 1],
              "turns": [{"action": "<tool_call>17*23</tool_call>", "observation": "391", "reward": 0.25},
                        {"action": "<answer>391</answer>", "observation": "", "reward": 0.5, "error": "step raised KeyError: 'x'"}],
              "observation_images": ["images/shown.png"]}
    single = record(1, 0, 0, "maths", 0.0, 0, "392", [])
    (tmp_path / "trajectories" / "images").mkdir(parents=True)
    Image.new("RGB", (4, 4), (0, 90, 200)).save(tmp_path / "trajectories" / "images" / "shown.png")
    (tmp_path / "trajectories" / "step_000001.rank0.jsonl").write_text(json.dumps(multi) + "\n" + json.dumps(single) + "\n")
    html_path, summary_path = write_report(tmp_path)
    page, summary = html_path.read_text(), json.loads(summary_path.read_text())
    assert page.count('<span class="obs" title="observation (not trained)">') == 2
    assert "turns <b>2</b>" in page and "environment reward <b>0.75</b>" in page
    assert "turn 2 error <b>step raised KeyError: &#x27;x&#x27;</b>" in page
    assert page.count('title="shown by the environment: images/shown.png"') == 1 and "data:image/png;base64," in page
    assert summary["overall"]["entropy/max"] == 0.6 and summary["steps"]["1"]["entropy/max"] == 0.6


def test_report_embeds_only_files_of_the_run_directory(tmp_path):
    """A record is data: images it names outside the run directory (absolute, `..`, a symlink
    out) are listed as not shown, never embedded; the run's own image still is."""
    import base64
    import os

    from tests.report_fixtures import record

    outside = tmp_path / "secret.png"
    Image.new("RGB", (4, 4), (250, 0, 0)).save(outside)
    run = tmp_path / "run"
    images = run / "trajectories" / "images"
    images.mkdir(parents=True)
    Image.new("RGB", (4, 4), (0, 90, 200)).save(images / "own.png")
    os.symlink(outside, images / "link.png")
    named = ["/etc/hostname", "../../secret.png", "images/link.png", str(outside), "images/own.png"]
    (run / "trajectories" / "step_000001.rank0.jsonl").write_text(json.dumps(record(1, 0, 0, "s", 1.0, 1, "hi", named)) + "\n")
    page = write_report(run)[0].read_text()
    sources = re.findall(r'<img src="([^"]+)"', page)
    assert sources == ["data:image/png;base64," + base64.b64encode((images / "own.png").read_bytes()).decode()]
    assert page.count("image outside the run directory, not shown") == 4
    for path in (outside, Path("/etc/hostname")):  # neither file's bytes, in any form an embed would take
        if path.is_file():
            assert base64.b64encode(path.read_bytes()).decode() not in page


def test_guard_events_are_marked_on_every_curve(run_dir):
    """A collapse, a rollback and a plateau in metrics.jsonl: a dashed line at each step on the
    report's curves (both groups), with a legend row per kind naming the steps."""
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = sorted({m["step"] for m in metrics})
    first, last = steps[0], steps[-1]
    metrics[-1] |= {"guards/collapse": 1, "guards/rollback": 1, "guards/rollback_to_step": first}
    metrics[0] |= {"guards/plateau": 1, "guards/collapse": 0}
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    write_report(run_dir)
    page = (run_dir / "report.html").read_text()
    charts = [parsed(svg) for svg in re.findall(r"<svg.*?</svg>", page, flags=re.S)]
    curves = {c.get("aria-label"): c for c in charts if c.findall("polyline")}
    assert len(curves) > 8  # the trajectories' curves and the logged metrics'
    spanning = [c for c in curves.values() if len(c.find("polyline").get("points").split()) == len(steps)]
    assert {"Reward mean by component", "Accuracy by data source", "rollout/reward_mean", "eval/accuracy"} <= {
        c.get("aria-label") for c in spanning}
    for chart in spanning:  # (a curve of fewer steps shows the events within its own)
        marked = {line.find("title").text: line.get("x1") for line in chart.findall("line[@class='event']")}
        assert set(marked) == {f"collapse warning at step {last}", f"rolled back at step {last} to the checkpoint of step {first}",
                               f"plateau warning at step {first}"}
        assert marked[f"collapse warning at step {last}"] != marked[f"plateau warning at step {first}"]
        legend = {t.text for t in chart.findall("text")}
        assert {f"collapse at step {last}", f"plateau at step {first}", f"rollback at step {last}"} <= legend


def test_events_outside_a_charts_steps_are_left_out():
    chart = parsed(line_chart({"a": [(0, 0), (10, 1)]}, "t", "step", "v",
                              [(5, "collapse", "in"), (50, "collapse", "out"), (5, "unknown", "no colour")]))
    assert [line.find("title").text for line in chart.findall("line[@class='event']")] == ["in"]
    assert "collapse at step 5" in {t.text for t in chart.findall("text")}
