import json
import subprocess
import sys


def loaded_after_import(modules: str, candidates: tuple[str, ...]) -> list[str]:
    """Which of `candidates` a fresh interpreter has loaded after importing `modules`."""
    code = f"import json, sys, {modules}; print(json.dumps([m for m in {list(candidates)!r} if m in sys.modules]))"
    return json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def test_importing_vlrft_pulls_in_no_heavy_dependency():
    assert loaded_after_import("vlrft, vlrft.cli, vlrft.config, vlrft.trainer.spmd_trainer, vlrft.experience.maker",
                               ("deepspeed", "vllm", "flash_attn", "wandb")) == []


def test_the_cli_starts_a_server_or_a_report_without_torch():
    # `vlrft reward-server` and `vlrft report` need neither torch nor transformers: a server
    # started per test or per node is up seconds sooner (torch alone imports in 2-6 s).
    assert loaded_after_import("vlrft.cli, vlrft.rewards.server, vlrft.trajectory.report", ("torch", "transformers")) == []
