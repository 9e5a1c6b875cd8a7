import subprocess
import sys


def test_importing_vlrft_pulls_in_no_heavy_dependency():
    code = (
        "import sys, vlrft, vlrft.cli, vlrft.config, vlrft.trainer.spmd_trainer, vlrft.experience.maker;"
        "print(sorted(m for m in ('deepspeed', 'vllm', 'flash_attn', 'wandb') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_cli_starts_a_server_or_a_report_without_torch():
    # `vlrft reward-server` and `vlrft report` need neither torch nor transformers: a server
    # started per test or per node is up seconds sooner (torch alone imports in 2-6 s).
    code = ("import sys, vlrft.cli, vlrft.rewards.server, vlrft.trajectory.report;"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
