"""A small run directory written by hand, in the TrajectorySaver's format, for the report tests.

Steps 10 and 20, ranks 0 and 1, data sources "colours" (with images) and "maths" (text only).
Group ids restart at 0 each step, as the saver's prompt indices can. Rewards by group:

  step 10  g0 colours [1.0, 0.0]   g1 maths [0.5, 0.5] (equal)   g2 colours [0.25, 1.0]   g3 maths [1.0, 0.0]
  step 20  g0 colours [1.0, 0.75]  g1 maths [0.0, 1.0]; its 0.0 response is `<script>alert(1)</script>`

"correct" is 1 where the reward is 1.0, else 0, except step 20 g0's 0.75 (correct, format off).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from PIL import Image, ImageDraw

ALERT = "<script>alert(1)</script>"
ALERT_TOKENS = ["<script>", "alert(1)", "</script>"]
# The highest token entropy of step 20, so the only token certain to be in its top 10%.
ALERT_PEAK_ENTROPY = 5.0


def write_png(path: Path, colour: str) -> None:
    image = Image.new("RGB", (48, 48), "white")
    ImageDraw.Draw(image).ellipse((8, 8, 40, 40), fill=colour)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)


def record(step: int, rank: int, group_id: int, source: str, reward: float, correct: float, text: str,
           images: list[str], tokens: list[str] | None = None, entropy: list[float] | None = None) -> dict:
    tokens = tokens or [word + " " for word in text.split()]
    entropy = entropy or [0.1 * (i % 4) for i in range(len(tokens))]
    return {
        "step": step, "rank": rank, "id": f"{source}-{step}-{group_id}", "data_source": source,
        "group_id": group_id,
        "prompt_text": f"<|im_start|>user\n<|vision_start|><|image_pad|><|image_pad|><|vision_end|>"
                       f"What is it? {ALERT}<|im_end|>\n<|im_start|>assistant\n",
        "images": images, "response_text": text,
        "response_ids": list(range(len(tokens))), "response_tokens": tokens,
        "logprobs": [-h for h in entropy], "entropy": entropy,
        "reward": reward,
        # The format recipe only applies to colours: a maths response's format is null.
        "components": {"accuracy": correct, "format": 0.5 if source == "colours" else None},
        "advantage": reward - 0.5, "response_length": len(tokens), "truncated": reward == 0.0,
        "correct": correct,
    }


def fake_records() -> dict[tuple[int, int], list[dict]]:
    red, blue = ["images/red0000000000000000.png"], ["images/blue000000000000000.png"]
    answer = "The shape is red so the answer is <answer>red</answer>"
    return {
        (10, 0): [record(10, 0, 0, "colours", 1.0, 1, answer, red), record(10, 0, 0, "colours", 0.0, 0, "blue", red),
                  record(10, 0, 1, "maths", 0.5, 0, "2 + 2 = 5", []), record(10, 0, 1, "maths", 0.5, 0, "5", [])],
        (10, 1): [record(10, 1, 2, "colours", 0.25, 0, "green", blue),
                  record(10, 1, 2, "colours", 1.0, 1, answer, blue),
                  record(10, 1, 3, "maths", 1.0, 1, "4", []), record(10, 1, 3, "maths", 0.0, 0, "wait wait 3", [])],
        (20, 0): [record(20, 0, 0, "colours", 1.0, 1, answer, red), record(20, 0, 0, "colours", 0.75, 1, "red", red)],
        (20, 1): [record(20, 1, 1, "maths", 0.0, 0, ALERT, [], ALERT_TOKENS, [0.2, ALERT_PEAK_ENTROPY, 0.3]),
                  record(20, 1, 1, "maths", 1.0, 1, "2 + 2 = 4 so the answer is 4", [])],
    }


METRICS = [
    {"step": 10, "rollout/reward_mean": 0.53125, "train/kl": 0.01},
    {"step": 10, "eval/accuracy": 0.25},
    {"step": 20, "rollout/reward_mean": 0.6875, "train/kl": 0.02},
    {"step": 20, "eval/accuracy": 0.5},
]


def write_fake_run(run_dir: Path) -> Path:
    """Write the run directory described above under `run_dir`; return it."""
    trajectories = run_dir / "trajectories"
    write_png(trajectories / "images/red0000000000000000.png", "red")
    write_png(trajectories / "images/blue000000000000000.png", "blue")
    for (step, rank), records in fake_records().items():
        lines = "".join(json.dumps(r) + "\n" for r in records)
        (trajectories / f"step_{step:06d}.rank{rank}.jsonl").write_text(lines, encoding="utf-8")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in METRICS), encoding="utf-8")
    return run_dir


def browser_missing() -> str | None:
    """Why a real headless Chromium cannot be driven here, or None."""
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install selenium)"
    if not (shutil.which("chromium") and shutil.which("chromedriver")):
        return "chromium/chromedriver not on PATH (apt-get install chromium chromium-driver)"
    return None


def chromium(javascript: bool = True):
    """A headless Chromium driven by selenium. The driver path is given explicitly, so
    selenium-manager never tries to download a browser or a driver."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1400,1800"):
        options.add_argument(flag)
    options.binary_location = shutil.which("chromium")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    if not javascript:
        options.add_experimental_option("prefs", {"profile.managed_default_content_settings.javascript": 2})
    return webdriver.Chrome(options=options, service=Service(executable_path=shutil.which("chromedriver")))
