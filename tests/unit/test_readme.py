"""The README is a short front door: its set-up commands come first and every local link in it
and in docs/ points at a file that exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))

SETUP_COMMANDS = [
    'pip install torch==2.13.0 -e ".[dev]" && bash examples/color_shapes/run.sh   # demo: GRPO on a tiny VLM, 2 CPU ranks',
    'pip install torch==2.13.0 -e ".[dev]" && python -m pytest -q -n 2            # tests',
]

# [text](target) or [text](target "title"); images too. Code spans are removed first.
_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")


def _first_code_block(text: str) -> list[str]:
    match = re.search(r"^```[^\n]*\n(.*?)^```", text, re.S | re.M)
    assert match, "README.md has no code block"
    return [line.rstrip() for line in match.group(1).splitlines() if line.strip()]


def _local_links(path: Path) -> list[str]:
    text = _CODE_SPAN.sub("", _FENCE.sub("", path.read_text(encoding="utf-8")))
    targets = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # http(s):, mailto:, ... and links within the page
        targets.append(target.split("#", 1)[0])
    return targets


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines; move reference material to docs/"


def test_readme_opens_with_the_two_setup_commands():
    text = README.read_text(encoding="utf-8")
    assert _first_code_block(text) == SETUP_COMMANDS
    # The block comes right after the title: nothing else is read first.
    before = text[: text.index("```")]
    assert [line for line in before.splitlines() if line.strip()] == ["# vlrft"]


def test_readme_links_every_docs_page():
    linked = {Path(t).name for t in _local_links(README) if t.startswith("docs/")}
    missing = [page.name for page in DOCS if page.name not in linked]
    assert not missing, f"docs pages the README's table does not link: {missing}"


def test_local_links_point_at_files():
    broken = []
    for page in [README, *DOCS]:
        for target in _local_links(page):
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, "links to missing files:\n" + "\n".join(broken)


def test_link_finder_finds_links(tmp_path):
    """The checks above are only as good as the link pattern: it must see plain, titled and
    anchored links and skip URLs, anchors and code."""
    sample = tmp_path / "sample.md"
    sample.write_text(
        "[a](a.md) [b](docs/b.md#part) [c](c.txt \"title\") [u](https://x.org/y.md) [h](#here)\n"
        "`[d](in_code.md)`\n```\n[e](in_fence.md)\n```\n",
        encoding="utf-8",
    )
    assert _local_links(sample) == ["a.md", "docs/b.md", "c.txt"]
