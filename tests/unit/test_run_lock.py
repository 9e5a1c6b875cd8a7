"""One run per output directory: the lock on output.dir/.vlrft.lock refuses a second process,
names the holder, and is gone when the holder dies, however it dies."""

import os
import socket
import subprocess
import sys

import pytest

from vlrft.errors import ConfigError
from vlrft.trainer.run_lock import lock_run_dir

HOLDER = "import sys, time; from vlrft.trainer.run_lock import lock_run_dir; lock_run_dir(sys.argv[1]); " \
         "print('locked', flush=True); time.sleep(600)"


def test_a_second_process_is_refused_until_the_holder_dies(tmp_path):
    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ConfigError, match="'output.dir': .*run is in use by another run "
                           rf"\(pid {holder.pid} on host {socket.gethostname()}\)") as refused:
            lock_run_dir(run)
        assert "\n" not in str(refused.value)
    finally:
        holder.kill()  # SIGKILL: no clean-up code runs; the kernel drops the lock
        holder.wait()
    lock_run_dir(run)
    lock_run_dir(run)  # the same process again (a trainer rebuilt in a notebook): the same run
    assert (run / ".vlrft.lock").read_text() == f"pid {os.getpid()} on host {socket.gethostname()}\n"
