"""Hostile programs against the code sandbox, part two: the kernel's side doors. A program run
by a root trainer (as in most containers, and in CI) must not be the host's root; every system
call outside the allowlist (vlrft/isolation/seccomp_policy.py) must be refused, whatever other
route it offers to a socket, a key, a mount or another process; the trainer's keys stay its own.

Runs only where bubblewrap works (`.ci/run` installs it)."""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.marks import needs_sandbox
from vlrft.isolation.launch import spawn_in_fresh_keyring
from vlrft.isolation.sandbox import run_python

pytestmark = needs_sandbox

LIBC = "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
KEYCTL = {"x86_64": 250, "aarch64": 219}  # the keyctl and add_key system calls' numbers
ADD_KEY = {"x86_64": 248, "aarch64": 217}


def test_the_sandbox_is_not_the_hosts_root():
    """Started by root, bwrap's uid 0 is the host's: /proc/sys (763 files) was writable, with
    kernel.core_pattern, whose `|helper` runs as root at the next core dump."""
    result = run_python("""
import os
writable = 0
for top, dirs, files in os.walk("/proc/sys"):
    writable += sum(os.access(os.path.join(top, name), os.W_OK) for name in files)
print("writable", writable)
for path in ("/proc/sys/kernel/core_pattern", "/proc/sysrq-trigger", "/proc/self/uid_map"):
    try:
        open(path, "w").close()
        print("opened", path)
    except OSError as err:
        print("refused", path, err.errno)
status = dict(line.split(":", 1) for line in open("/proc/self/status"))
print("uid", status["Uid"].split()[0], "caps", status["CapEff"].strip(), "nnp", status["NoNewPrivs"].strip())
try:
    os.setuid(0)
    print("became root")
except OSError as err:
    print("setuid refused", err.errno)
print("sys", os.listdir("/sys") if os.path.isdir("/sys") else "absent")
print("proc/sys", os.listdir("/proc/sys"))
""")
    out = result.stdout
    assert result.passed, result.stderr
    assert "writable 0" in out and "opened" not in out and "became root" not in out, out
    assert out.count("refused") == 4, out
    words = dict(line.split(" ", 1) for line in out.splitlines())
    uid = int(words["uid"].split()[0])
    assert uid != 0 and "caps 0000000000000000" in out and "nnp 1" in out, out
    assert words["sys"] in ("absent", "[]") and words["proc/sys"] == "[]", out


def _syscall_numbers() -> dict[str, int]:
    """This machine's number of each call below (libseccomp's table)."""
    from vlrft.isolation.seccomp_policy import _bindings

    sc = _bindings()
    return {name: sc.resolve_syscall(sc.system_arch(), name) for name in REFUSED}


# name -> arguments (harmless values: only the refusal is looked at). Every one is refused with
# EPERM; without the filter, several would work (io_uring, keyctl, personality, socket(AF_ALG)).
REFUSED = {
    "io_uring_setup": "1, ctypes.create_string_buffer(120)",  # IORING_OP_SOCKET opens any family
    "io_uring_enter": "0, 1, 0, 0, None, 0",
    "io_uring_register": "0, 0, None, 0",
    "keyctl": "0, -3, 1",  # KEYCTL_GET_KEYRING_ID of the session keyring
    "add_key": "b'user', b'planted', b'x', 1, -3",
    "request_key": "b'user', b'planted', None, -3",
    "bpf": "0, None, 0",
    "perf_event_open": "ctypes.create_string_buffer(128), 0, -1, -1, 0",
    "userfaultfd": "0",
    "mount": "b'none', b'/tmp', b'tmpfs', 0, None",
    "umount2": "b'/tmp', 2",
    "unshare": "0x10000000",  # CLONE_NEWUSER
    "setns": "0, 0",
    "pivot_root": "b'/tmp', b'/tmp'",
    "chroot": "b'/tmp'",
    "open_by_handle_at": "-100, ctypes.create_string_buffer(136), 0",
    "name_to_handle_at": "-100, b'/tmp', ctypes.create_string_buffer(136), ctypes.byref(ctypes.c_int()), 0",
    "process_vm_readv": "1, None, 0, None, 0, 0",
    "ptrace": "16, 1, 0, 0",  # PTRACE_ATTACH to the sandbox's init
    "kcmp": "1, 2, 0, 0, 0",
    "pidfd_getfd": "0, 0, 0",
    "memfd_secret": "0",
    "io_setup": "1, ctypes.byref(ctypes.c_ulong())",
    "mlock": "0, 4096",
    "semget": "0, 1, 0o1600",
    "mq_open": "b'/q', 0o100, 0o600, None",
    "fanotify_init": "0, 0",
    "init_module": "None, 0, b''",
    "kexec_load": "0, 0, None, 0",
    "reboot": "0xfee1dead, 672274793, 0x4321fedc, None",
    "swapon": "b'/tmp/swap', 0",
    "syslog": "3, ctypes.create_string_buffer(64), 64",
    "sethostname": "b'x', 1",
    "clock_settime": "0, ctypes.create_string_buffer(16)",
    "adjtimex": "ctypes.create_string_buffer(256)",
    "personality": "0x0400000",  # READ_IMPLIES_EXEC
    "fork": "",
    "vfork": "",
    "clone": "0x11, 0, 0, 0, 0",  # SIGCHLD without CLONE_THREAD: a new process
    "socket": "38, 5, 0",  # AF_ALG: kernel crypto, a common exploit entry
    "fsopen": "b'tmpfs', 0",
    "open_tree": "-100, b'/tmp', 1",
    "quotactl": "0, None, 0, None",
    "acct": "None",
    # Pipes holding page references: vmsplice of 4 KiB pins a whole 2 MiB huge page.
    "vmsplice": "1, None, 0, 0",
    "splice": "0, None, 1, None, 4096, 0",
    "tee": "0, 1, 4096, 0",
    "fallocate": "1, 1, 0, 1 << 30",  # FALLOC_FL_KEEP_SIZE on stdout: disk blocks RLIMIT_FSIZE does not see
    "socketpair": "30, 2, 0, ctypes.byref((ctypes.c_int * 2)())",  # AF_TIPC: loads its module on demand
}
# The same calls with other arguments: a family or type the filter does not let through.
REFUSED_ARGUMENTS = {
    "AF_INET SOCK_PACKET (a packet socket)": ("socket", "2, 10, 0"),
    "AF_INET SOCK_RAW": ("socket", "2, 3, 1"),
    "AF_UNIX with a flag bit over a refused type": ("socket", "1, 0x80000 | 10, 0"),
    # Protocols whose kernel modules load on demand (a family-and-type filter let them through).
    "AF_INET SOCK_STREAM SCTP": ("socket", "2, 1, 132"),
    "AF_INET6 SOCK_SEQPACKET SCTP": ("socket", "10, 5, 132"),
    "AF_INET SOCK_DGRAM L2TP": ("socket", "2, 2, 115"),
    "AF_INET SOCK_STREAM MPTCP": ("socket", "2, 1, 262"),
    "AF_INET SOCK_DGRAM UDP-Lite": ("socket", "2, 2, 136"),
    "TCP with high bits the kernel would truncate away": ("socket", "2, 1, ctypes.c_long(0x100000006)"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_system_calls_outside_the_allowlist_are_refused(name):
    number = _syscall_numbers()[name]
    if number < 0:
        pytest.skip(f"{name} does not exist on {platform.machine()}")
    args = f", {REFUSED[name]}" if REFUSED[name] else ""
    result = run_python(LIBC + f"print(libc.syscall({number}{args}), ctypes.get_errno())\n")
    assert result.stdout.split() == ["-1", str(errno.EPERM)], (result.stdout, result.stderr)


@pytest.mark.parametrize("what", REFUSED_ARGUMENTS)
def test_allowed_calls_with_refused_arguments_are_refused(what):
    name, args = REFUSED_ARGUMENTS[what]
    number = _syscall_numbers()[name]
    result = run_python(LIBC + f"print(libc.syscall({number}, {args}), ctypes.get_errno())\n")
    assert result.stdout.split() == ["-1", str(errno.EPERM)], (result.stdout, result.stderr)


def test_clone3_says_enosys_and_threads_still_start():
    """clone3's flags sit in memory a filter cannot read, so it answers ENOSYS and libc falls
    back to clone, whose flags the filter reads: threads start, processes do not."""
    from vlrft.isolation.seccomp_policy import _bindings

    sc = _bindings()
    clone3 = sc.resolve_syscall(sc.system_arch(), "clone3")
    result = run_python(LIBC + f"""
print(libc.syscall({clone3}, ctypes.create_string_buffer(88), 88), ctypes.get_errno())
import threading
box = []
thread = threading.Thread(target=box.append, args=(1,))
thread.start()
thread.join()
print(box)
""")
    assert result.stdout.split("\n")[:2] == [f"-1 {errno.ENOSYS}", "[1]"], result


def test_kernel_memory_is_bounded_with_the_programs_own():
    """Empty files cost the tmpfs nothing of its size but an inode each: a loop of them held
    3.5 GiB of kernel memory. A memory cgroup (root, where the controller is writable) counts
    it with the program's memory."""
    from vlrft.isolation import memory_cgroup
    from vlrft.isolation.launch import TMPFS_BYTES

    if memory_cgroup.parent() is None:
        pytest.skip("no writable memory cgroup here: the kernel's memory for a sandbox is bounded by its timeout only")
    result = run_python("""
import os
count = 0
try:
    while True:
        os.mknod("f" * 200 + str(count))
        count += 1
except (OSError, MemoryError) as err:
    print(count, type(err).__name__, flush=True)
""", memory_mb=64, timeout_s=60)
    limit = 64 * 2**20 + TMPFS_BYTES + memory_cgroup.KERNEL_MARGIN
    assert not result.timed_out, result
    count = int(result.stdout.split()[0]) if result.stdout else 0  # nothing printed: killed in its cgroup
    assert count * 512 < limit, (count, result)  # each inode with its name takes well over 512 bytes


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the x32 ABI exists on x86_64 only")
def test_another_abi_is_refused():
    """A 64-bit kernel also takes x32 calls (number | 0x40000000), with other numbers: none is
    allowed, however the filter's checks are written."""
    result = run_python(LIBC + "print(libc.syscall(0x40000000 | 39), ctypes.get_errno())\n")
    assert result.stdout.split() == ["-1", str(errno.EPERM)], result


def _keyctl(*args) -> int:
    return ctypes.CDLL(None, use_errno=True).syscall(KEYCTL[platform.machine()], *args)


def _add_key(description: bytes, payload: bytes) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(ADD_KEY[platform.machine()], b"user", description, payload, len(payload), -3)


@pytest.fixture
def planted_key():
    """A key in this process's session keyring, as a trainer's credentials might be."""
    if platform.machine() not in KEYCTL:
        pytest.skip("keyctl numbers written for x86_64 and aarch64")
    secret = f"KEY-{secrets.token_hex(12)}".encode()
    key = _add_key(b"vlrft-redteam", secret)
    if key < 0:
        pytest.skip(f"this process cannot add keys (errno {ctypes.get_errno()}): nothing to protect")
    yield key, secret
    _keyctl(3, key)  # KEYCTL_REVOKE


def test_the_trainers_keys_are_out_of_reach(planted_key):
    key, secret = planted_key
    result = run_python(LIBC + f"""
buf = ctypes.create_string_buffer(256)
for name, nr, args in (("read", 11, ({key}, buf, 256)), ("revoke", 3, ({key},)), ("describe", 6, ({key}, buf, 256))):
    print(name, libc.syscall({KEYCTL[platform.machine()]}, nr, *args), ctypes.get_errno(), buf.raw.rstrip(b"\\0"))
""")
    assert secret.decode() not in result.stdout + result.stderr
    assert [line.split()[1:3] for line in result.stdout.splitlines()] == [["-1", str(errno.EPERM)]] * 3, result
    buf = ctypes.create_string_buffer(256)
    assert _keyctl(11, key, buf, 256) == len(secret) and buf.raw[:len(secret)] == secret  # still there, unrevoked


def test_each_sandbox_starts_in_a_fresh_session_keyring(planted_key):
    """Defence in depth behind the allowlist: the process that becomes bwrap holds a new, empty
    session keyring, not the trainer's (so not even possession of its keys)."""
    key, _ = planted_key
    mine = _keyctl(0, -3, 0)  # KEYCTL_GET_KEYRING_ID
    nr = KEYCTL[platform.machine()]
    probe = (LIBC + "buf = ctypes.create_string_buffer(64)\n"
             f"print(libc.syscall({nr}, 0, -3, 0), libc.syscall({nr}, 11, {key}, buf, 64), ctypes.get_errno())\n")
    child = spawn_in_fresh_keyring([sys.executable, "-I", "-c", probe], stdout=subprocess.PIPE, text=True)
    out, _ = child.communicate(timeout=30)
    theirs, read, err = (int(v) for v in out.split())
    if theirs == mine:
        pytest.skip("keyctl(JOIN_SESSION_KEYRING) is refused here: children keep the caller's keyring")
    assert theirs > 0 and read == -1 and err in (errno.EACCES, errno.ENOKEY), out
    assert _keyctl(0, -3, 0) == mine  # this thread's own keyring did not change


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/python3") or not os.path.exists("/usr/bin/setpriv"),
                    reason="needs root (to become another user), the system's python3 and setpriv")
def test_a_trainer_that_is_not_root_gets_the_same_sandbox():
    """The other way in: an ordinary user's bwrap makes a user namespace. Run as `nobody` with
    the system's interpreter (this one may live under /root, which nobody can enter)."""
    import pyseccomp

    script = f"""
import sys
from pathlib import Path
sys.path[:0] = [{str(Path(__file__).resolve().parents[2])!r}, {str(Path(pyseccomp.__file__).parent)!r}]
from vlrft.isolation.sandbox import isolation_problem, run_python
if isolation_problem() is not None:
    print("unavailable", isolation_problem())
    raise SystemExit
print(run_python({LIBC!r} + "import os\\nprint(os.getuid(), libc.syscall({KEYCTL.get(platform.machine(), 250)}, 0, -3, 0), ctypes.get_errno())\\n"
                 "print(sum(os.access(os.path.join(t, f), os.W_OK) for t, _, fs in os.walk('/proc/sys') for f in fs))\\n").stdout)
"""
    done = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-I", "-c", script],
                          capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"})
    if "unavailable" in done.stdout or "ModuleNotFoundError" in done.stderr:
        pytest.skip(f"no sandbox for an ordinary user here: {(done.stdout + done.stderr).strip()[-200:]}")
    assert done.stdout.split() == ["65534", "-1", str(errno.EPERM), "0"], (done.stdout, done.stderr)


def test_tcp_and_udp_sockets_still_open_and_no_pseudo_terminal_does():
    """What the protocol rules let through; and /dev/pts is hidden: a pseudo-terminal takes the
    ioctl that attaches a line discipline, whose module loads on demand."""
    result = run_python("""
import os, socket
for family in (socket.AF_INET, socket.AF_INET6):
    for kind, protocol in ((socket.SOCK_STREAM, 0), (socket.SOCK_STREAM, 6), (socket.SOCK_DGRAM, 0), (socket.SOCK_DGRAM, 17)):
        socket.socket(family, kind, protocol).close()
socket.socketpair()
print("sockets ok")
for path in ("/dev/ptmx", "/dev/pts/ptmx"):
    try:
        os.open(path, os.O_RDWR | os.O_NOCTTY)
        print("opened", path)
    except OSError as err:
        print(type(err).__name__)
""")
    assert result.stdout.split("\n")[:3] == ["sockets ok", "FileNotFoundError", "FileNotFoundError"], result


def test_tcp_buffers_count_against_the_sandbox_under_cgroup_v1():
    """cgroup v1 keeps TCP buffers out of a cgroup's usage until they have a limit of their own:
    send queues filled and never read, their sockets closed (the queue stays, the descriptor
    goes), held 220 MiB of host memory past a 256 MiB sandbox."""
    from vlrft.isolation import memory_cgroup

    where = memory_cgroup.parent()
    if where is None or where[1] != 1:
        pytest.skip("no writable cgroup v1 memory hierarchy here (v2 counts TCP buffers with the rest)")
    result = run_python("""
import socket
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen(64)
kept, queued = [], 0
try:
    while queued < 512 << 20:
        sender = socket.socket()
        sender.connect(server.getsockname())
        kept.append(server.accept()[0])
        sender.setblocking(False)
        while True:
            try:
                queued += sender.send(b"x" * 65536)
            except BlockingIOError:
                break
        sender.close()
except OSError:
    pass
print(queued >> 20, flush=True)
""", memory_mb=256, timeout_s=60)
    assert result.stdout.strip(), result
    assert int(result.stdout.split()[0]) <= 2 * memory_cgroup.TCP_BUFFER_BYTES >> 20, result


ZOMBIE_COUNT = """
import os, sys, time
assert os.getpid() == 1  # PID 1 of a PID namespace, as a trainer started as a container's command
from vlrft.isolation.sandbox import run_python
for _ in range(8):
    assert run_python("print(1)").stdout == "1\\n"
time.sleep(1)
stats = [open(f"/proc/{p}/stat").read() for p in os.listdir("/proc") if p.isdigit() and os.path.exists(f"/proc/{p}/stat")]
print(sum(1 for s in stats if s.rpartition(") ")[2].split()[:2] == ["Z", "1"]))
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root and unshare for a PID namespace")
def test_sandbox_calls_leave_no_zombie_behind_when_the_trainer_is_pid_1():
    """bwrap's outer process exits before its PID-namespace init, which the kernel hands to the
    nearest subreaper or PID 1: a trainer that is PID 1 of its container never reaped them, one
    pid per call until fork fails. Such a trainer reaps them as each call ends."""
    done = subprocess.run(["unshare", "--fork", "--pid", "--mount-proc", sys.executable, "-c", ZOMBIE_COUNT],
                          capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) == 0, done.stdout
