"""Start-up costs the launch path avoids: torchrun's --help in the example launcher, and the
inductor stack DeepSpeed would load for its Muon optimizer."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on PATH")
def test_launcher_reads_torchruns_shutdown_flag_from_its_source():
    snippet = re.search(r'run_py=\$\(python -c "(.+)"\)', LAUNCH.read_text()).group(1)
    source = Path(subprocess.run([sys.executable, "-c", snippet], capture_output=True, text=True, check=True).stdout.strip())
    help_text = subprocess.run(["torchrun", "--help"], capture_output=True, text=True).stdout
    assert source.name == "run.py" and source.is_file()
    assert ("--shutdown-timeout" in source.read_text()) == ("--shutdown-timeout" in help_text)
