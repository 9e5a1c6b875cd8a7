"""Start-up costs the launch path avoids: torchrun's --help in the example launcher, the
inductor stack DeepSpeed would load for its Muon optimizer, and the shared-memory all-reduce
DeepSpeed would compile for CPU ranks."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.process_env import fresh_process_env

LAUNCH = Path(__file__).resolve().parents[2] / "examples" / "launch.sh"


def test_deepspeed_backend_loads_without_torch_inductor():
    probe = (
        "import sys, vlrft.backends.deepspeed_backend\n"
        "from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam\n"
        "from deepspeed.runtime.zero.utils import is_zero_supported_optimizer\n"
        "print(sorted(m for m in sys.modules if m.startswith('torch._inductor.compile_fx')), MuonWithAuxAdam.__name__)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.split() == ["[]", "MuonWithAuxAdam"]


def test_deepspeed_compiles_no_shared_memory_allreduce_for_cpu_ranks(tmp_path):
    probe = (
        "import torch, deepspeed.comm.comm as comm\n"
        "from vlrft.distributed import init_distributed\n"
        "from vlrft.backends.deepspeed_backend import DeepSpeedBackend\n"
        "init_distributed()\n"
        "DeepSpeedBackend(torch.nn.Linear(4, 4), lr=0.1, weight_decay=0.0, grad_clip=1.0, zero_stage=2)\n"
        "print(type(comm.cdb).__name__, comm.cdb.shm_comm_op)\n"
    )
    env = fresh_process_env(TORCH_EXTENSIONS_DIR=str(tmp_path))  # (where a build would land)
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-2:] == ["TorchBackend", "None"]
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on PATH")
def test_launcher_reads_torchruns_shutdown_flag_from_its_source():
    snippet = re.search(r'run_py=\$\(python -c "(.+)"\)', LAUNCH.read_text()).group(1)
    source = Path(subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, check=True).stdout.strip())
    help_text = subprocess.run(["torchrun", "--help"], capture_output=True, text=True).stdout
    assert source.name == "run.py" and source.is_file()
    assert ("--shutdown-timeout" in source.read_text()) == ("--shutdown-timeout" in help_text)
