import subprocess
import sys


def test_importing_vlrft_pulls_in_no_heavy_dependency():
    code = (
        "import sys, vlrft, vlrft.cli, vlrft.config, vlrft.trainer.spmd_trainer, vlrft.experience.maker;"
        "print(sorted(m for m in ('deepspeed', 'vllm', 'flash_attn', 'wandb') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
