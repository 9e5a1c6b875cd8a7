"""Build and pip-install a one-module reward-recipe plugin package (tests only). Built with the
installed setuptools (no build isolation, so no index is needed): the dev extra asks for 70.1+,
the first that builds wheels without the `wheel` package (a Python 3.11 venv brings 65)."""

import subprocess
import sys
from pathlib import Path


def install_recipe_plugin(tmp_path: Path, package: str, recipe: str, source: str) -> Path:
    """Installs package `package` (whose __init__ is `source`) into its own target directory,
    registering `package:recipe` under the entry-point name `recipe` in the group
    `vlrft.reward_recipes`; returns the directory to put on sys.path / PYTHONPATH."""
    src = tmp_path / f"{package}_src"
    (src / package).mkdir(parents=True)
    (src / package / "__init__.py").write_text(source)
    (src / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=70.1"]\nbuild-backend = "setuptools.build_meta"\n'
        f'[project]\nname = "{package.replace("_", "-")}"\nversion = "0.1"\n'
        f'[project.entry-points."vlrft.reward_recipes"]\n{recipe} = "{package}:{recipe}"\n'
    )
    site = tmp_path / f"{package}_site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(src)], check=True, capture_output=True)
    return site
