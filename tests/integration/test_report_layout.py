"""The report's tables in a real headless Chromium at common window widths: measured from the
element boxes the browser laid out, no two cells overlap, every cell's text lies inside its cell,
and every cell lies inside its section. A page that merely loads proves nothing about layout:
a metrics table of long unbreakable names once ran its values under the next column's names
and out of the card.

Needs the `chromium` and `chromedriver` executables and `pip install selenium`; skipped when
any is missing (tests/report_fixtures.py).
"""

from __future__ import annotations

import json

import pytest

from tests.integration.test_report_browser import browser  # noqa: F401 (a fixture: one Chromium per test)
from tests.report_fixtures import browser_missing, write_fake_run
from vlrft.trajectory.report import write_report

pytestmark = pytest.mark.integration

if browser_missing():
    pytest.skip(browser_missing(), allow_module_level=True)

WIDTHS = (1000, 1280, 1600)

# Names as a real run logs them (trainer, rollout, async, distillation, trajectory statistics),
# many with no space to break at.
LOGGED_NAMES = [
    "async/rollout_wait_seconds", "async/staleness_max", "async/staleness_mean", "async/trainer_wait_seconds",
    "async/updates_mid_batch", "distill/reverse_kl", "distill/teacher_argmax_match", "distill/teacher_seconds",
    "eval/accuracy", "eval/source/colour_shapes_with_distractors/accuracy", "perf/cuda_allocated_gib",
    "perf/cuda_reserved_gib", "perf/experience_seconds", "perf/generate_seconds", "perf/host_rss_gib", "perf/mfu",
    "perf/rank_imbalance_before", "perf/step_seconds", "perf/sync_seconds", "perf/tokens_per_second_per_gpu",
    "perf/update_seconds", "rollout/accuracy", "rollout/correction_masked_frac", "rollout/correction_weight_mean",
    "rollout/dropped_group_frac", "rollout/engine_logprob_diff_max", "rollout/engine_logprob_diff_mean",
    "rollout/entropy", "rollout/mismatch_kl", "rollout/prefix_cache_hit_rate", "rollout/response_length",
    "rollout/reward_mean", "rollout/truncated_frac", "train/clip_frac", "train/drift_kl", "train/entropy",
    "train/grad_norm", "train/kl", "train/kl_coef", "train/loss", "train/lr", "train/pg_loss",
    "train/skipped_nonfinite_steps", "traj/component/format_strict_with_reasoning_tags/mean",
    "traj/source/colour_shapes_with_distractors/reward_mean",
]

# Every cell (th, td) of the overview's and per-source tables: its box, and the box of its text.
MEASURE_CELLS = """
const cells = [];
for (const sectionId of ["overview", "per-source"]) {
  const section = document.getElementById(sectionId);
  const card = section.getBoundingClientRect();
  for (const cell of section.querySelectorAll("th, td")) {
    const box = cell.getBoundingClientRect();
    const range = document.createRange();
    range.selectNodeContents(cell);
    const text = range.getBoundingClientRect();
    cells.push({section: sectionId, text: cell.textContent,
                box: [box.left, box.top, box.right, box.bottom],
                content: [text.left, text.top, text.right, text.bottom],
                card: [card.left, card.top, card.right, card.bottom]});
  }
}
return cells;
"""

TOLERANCE = 0.5  # px: sub-pixel rounding of adjacent borders


def overlap(a: list[float], b: list[float]) -> bool:
    """Whether two [left, top, right, bottom] boxes share more than a rounding error of area."""
    return (min(a[2], b[2]) - max(a[0], b[0]) > TOLERANCE) and (min(a[3], b[3]) - max(a[1], b[1]) > TOLERANCE)


def inside(inner: list[float], outer: list[float]) -> bool:
    return (inner[0] >= outer[0] - TOLERANCE and inner[1] >= outer[1] - TOLERANCE
            and inner[2] <= outer[2] + TOLERANCE and inner[3] <= outer[3] + TOLERANCE)


def layout_faults(cells: list[dict]) -> list[str]:
    """Each overlap of two cells, each text sticking out of its cell, each cell outside its section."""
    faults = []
    for cell in cells:
        if not inside(cell["box"], cell["card"]):
            faults.append(f"{cell['section']}: cell {cell['text']!r} {cell['box']} runs past its section {cell['card']}")
        if cell["text"].strip() and not inside(cell["content"], cell["box"]):
            faults.append(f"{cell['section']}: the text of {cell['text']!r} {cell['content']} sticks out of its "
                          f"cell {cell['box']}")
    for i, a in enumerate(cells):
        faults += [f"cells {a['text']!r} {a['box']} and {b['text']!r} {b['box']} overlap"
                   for b in cells[i + 1:] if overlap(a["box"], b["box"])]
    return faults




@pytest.fixture(scope="module")
def report_uri(tmp_path_factory) -> str:
    run_dir = write_fake_run(tmp_path_factory.mktemp("layout") / "run")
    lines = [{"step": step} | {name: round(1234.5678 / (k + 1) * step, 6) for k, name in enumerate(LOGGED_NAMES)}
             for step in (10, 20)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    return write_report(run_dir)[0].as_uri()


@pytest.mark.parametrize("width", WIDTHS)
def test_metric_tables_lay_out_without_overlap(browser, report_uri, width):
    browser.set_window_size(width, 1200)
    browser.get(report_uri)
    cells = browser.execute_script(MEASURE_CELLS)
    shown = {cell["text"] for cell in cells}
    assert {"perf/tokens_per_second_per_gpu", "rollout/engine_logprob_diff_mean", "reward/mean"} <= shown
    assert layout_faults(cells) == []
