"""The sandbox's system-call allowlist (vlrft/isolation/seccomp_policy.py), per architecture: built
from Docker's default profile by libseccomp, with what the sandbox takes out, for x86_64 and
aarch64 alike (the filter is written for the machine that runs it; here both are compiled)."""

from __future__ import annotations

import re
import tempfile

import pytest

from vlrft.isolation import seccomp_policy
from vlrft.isolation.seccomp_policy import ARCHES, DOCKER_DEFAULT_ALLOWED, REMOVED, allowed_names, build, make_filter

try:
    sc = seccomp_policy._bindings()
except (ImportError, RuntimeError) as err:  # no libseccomp: the sandbox refuses to start (its own test)
    pytest.skip(f"libseccomp is not usable here: {err}", allow_module_level=True)

# Never allowed, whatever Docker's list says next year: each is a known way around a sandbox.
MUST_REFUSE = {"io_uring_setup", "io_uring_enter", "io_uring_register", "keyctl", "add_key", "request_key",
               "bpf", "perf_event_open", "userfaultfd", "mount", "umount2", "unshare", "setns", "ptrace",
               "process_vm_readv", "process_vm_writev", "fork", "vfork", "memfd_create", "open_by_handle_at",
               "name_to_handle_at", "init_module", "kexec_load", "pivot_root", "chroot", "fsopen", "move_mount",
               "socketcall", "clone", "clone3", "socket", "personality"}  # the last four: only by their arguments
# Calls newer than the libseccomp on the machines here (2.5.4): skipped, so refused.
NEWER_THAN_LIBSECCOMP = {"getxattrat", "setxattrat", "removexattrat", "listxattrat", "mseal", "statmount",
                         "listmount", "riscv_hwprobe", "uretprobe"}


def pfc(machine: str) -> str:
    """The filter as libseccomp's readable pseudo code, for `machine`."""
    with tempfile.TemporaryFile("w+") as out:
        make_filter(machine).export_pfc(out)
        out.seek(0)
        return out.read()


def test_what_is_taken_out_was_there_and_nothing_dangerous_is_left():
    assert set(REMOVED) <= DOCKER_DEFAULT_ALLOWED  # each removal names a call of the source list
    assert len(DOCKER_DEFAULT_ALLOWED) == 361  # the published list, whole
    assert not MUST_REFUSE & allowed_names()
    assert {"read", "write", "openat", "mmap", "futex", "exit_group", "rt_sigaction"} <= allowed_names()


def test_every_allowed_name_is_a_system_call():
    """A misspelt name would silently allow nothing; an unknown one must be a call newer than
    this libseccomp (refused until it knows it)."""
    unknown = {name for name in allowed_names()
               if all(sc.resolve_syscall(getattr(sc.Arch, arch), name) == -1 for arch in ARCHES.values())}
    assert unknown <= NEWER_THAN_LIBSECCOMP, unknown - NEWER_THAN_LIBSECCOMP


@pytest.mark.parametrize("machine", ARCHES)
def test_the_filter_compiles_for_each_architecture(machine):
    program = build(machine)
    assert len(program) % 8 == 0 and len(program) > 8 * 100  # struct sock_filter entries
    text = pfc(machine)
    assert '"read"' in text and '"openat"' in text
    for name in ("io_uring_setup", "keyctl", "bpf", "ptrace", "fork"):
        assert f'"{name}"' not in text


def test_an_unknown_architecture_has_no_filter():
    with pytest.raises(RuntimeError, match="no seccomp rules are written for this architecture"):
        build("sparc64")


def test_the_argument_rules_refuse_what_they_should():
    """clone only with CLONE_THREAD; socket only for AF_UNIX, AF_INET, AF_INET6 and stream,
    datagram or seqpacket types; socketpair only for AF_UNIX; clone3 ENOSYS."""
    text = pfc("x86_64")
    clone = text[text.index('"clone" (56)'):]
    assert "& 0x00010000 == 65536" in clone.split("# filter for syscall")[0]
    socket = text[text.index('"socket" (41)'):].split("# filter for syscall")[0]
    assert sorted(set(int(v) for v in re.findall(r"\$a0.lo32 == (\d+)", socket))) == [1, 2, 10]
    assert sorted(set(int(v) for v in re.findall(r"\$a1.lo32 & 0x0000000f == (\d+)", socket))) == [1, 2, 5]
    pair = text[text.index('"socketpair" (53)'):].split("# filter for syscall")[0]
    assert re.findall(r"\$a0.lo32 == (\d+)", pair) == ["1"]
    clone3 = text[text.index('"clone3" (435)'):].split("# filter for syscall")[0]
    assert "ERRNO(38)" in clone3
