"""constraints/tested.txt (the versions CI last saw green; README, "Installing and testing")
pins every dependency the core and the dev extra ask for, at versions they accept."""

import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]


def pins() -> dict[str, str]:
    lines = (ROOT / "constraints" / "tested.txt").read_text().splitlines()
    pairs = [line.split("==") for line in lines if line and not line.startswith("#")]
    return {canonicalize_name(name): version for name, version in pairs}


def test_every_core_and_dev_requirement_is_pinned_at_an_accepted_version():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = project["dependencies"] + [r for group in ("dev", "rewards", "wandb", "tensorboard") for r in extras[group]]
    pinned = pins()
    checked = 0
    for text in wanted:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        if name in ("torch", "vlrft"):  # torch: named by the install command (CPU and CUDA builds differ)
            continue
        assert name in pinned, f"constraints/tested.txt has no pin for {name}"
        assert requirement.specifier.contains(pinned[name], prereleases=True), (name, pinned[name], str(requirement.specifier))
        checked += 1
    assert checked >= 10
    assert "torch" not in pinned
