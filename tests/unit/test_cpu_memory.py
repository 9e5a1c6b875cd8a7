"""CPU ranks keep freed tensor memory (vlrft/cpu_memory.py): once a loop of large tensor
allocations has run a few times, it no longer page-faults its memory in again, as it does
forever with glibc's defaults."""

import subprocess
import sys

import pytest

PROGRAM = """
import resource, sys, torch
from vlrft.cpu_memory import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
def step():  # a step's large temporaries (64, 12 and 20 MB: above glibc's mmap threshold), freed out of order
    x = torch.ones(16 * 2**20); y = torch.ones(3 * 2**20); del x
    z = torch.ones(5 * 2**20); del y, z
for _ in range(8):  # the allocator settles
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) // 4)
"""


def page_faults_per_step(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", PROGRAM, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator: Linux only")
def test_a_settled_loop_of_large_tensors_reuses_its_memory():
    pages = 64 * 2**20 // 4096  # the largest tensor's pages
    assert page_faults_per_step("default") > pages // 2  # mapped fresh every step
    assert page_faults_per_step("keep") < pages // 20  # the heap's pages, resident already
