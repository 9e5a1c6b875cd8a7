"""User-facing errors share one ground-floor base class, which the CLI turns into one line."""

import subprocess
import sys

import pytest

import vlrft.cli as cli
from vlrft.config import ConfigError
from vlrft.data.dataset import DataError
from vlrft.distributed import LaunchError
from vlrft.engines.vllm_engine import EngineSetupError
from vlrft.errors import VlrftError
from vlrft.metrics.external_sinks import MissingSinkPackage
from vlrft.rewards.mix import RewardError
from vlrft.trajectory.records import ReportError

USER_ERRORS = [
    (ConfigError, ValueError),
    (EngineSetupError, ValueError),
    (DataError, ValueError),
    (ReportError, ValueError),
    (RewardError, RuntimeError),
    (LaunchError, RuntimeError),
    (MissingSinkPackage, ImportError),
]


@pytest.mark.parametrize("error, builtin", USER_ERRORS)
def test_every_user_error_is_a_vlrft_error_and_keeps_its_builtin_base(error, builtin):
    assert issubclass(error, VlrftError) and issubclass(error, builtin)


@pytest.mark.parametrize("error", [e for e, _ in USER_ERRORS])
def test_the_cli_prints_any_user_error_as_one_line(error, monkeypatch, capsys):
    def broken(*args, **kwargs):
        raise error("data.train_path: row 3 has no 'messages'")

    monkeypatch.setattr(cli, "load_config", broken)
    assert cli.main(["train", "config.yaml"]) == 2
    assert capsys.readouterr().err == "vlrft: error: data.train_path: row 3 has no 'messages'\n"


def test_a_bug_keeps_its_traceback(monkeypatch):
    def broken(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(cli, "load_config", broken)
    with pytest.raises(KeyError):
        cli.main(["train", "config.yaml"])


def test_the_registries_do_not_import_the_config():
    # registry -> config -> checks -> registries was an import circle; errors.py is below both.
    code = "import sys, vlrft.registry, vlrft.errors; print('vlrft.config' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


def test_reward_server_kwargs_that_are_not_an_object_are_one_line(capsys):
    assert cli.main(["reward-server", "--recipe", "exact_match", "--kwargs", "[1]"]) == 2
    assert capsys.readouterr().err == "vlrft: error: --kwargs must be a JSON object, got [1]\n"
