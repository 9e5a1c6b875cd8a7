"""The system calls a sandboxed program may make: an allowlist, compiled by libseccomp.

Everything not allowed here fails with EPERM. The list is not ours to invent: it starts from
Docker's default seccomp profile (github.com/moby/profiles, seccomp/default.json, at commit
cd3bed8 of 2026-06-30; its unconditional SCMP_ACT_ALLOW names, copied below as they are),
a policy maintained against the kernel's new calls (io_uring left it in 2024). From that list
the sandbox removes what a Python program scoring a reward does not need and what would get
around the sandbox's own accounting (REMOVED, each with its reason), and narrows four calls
by their arguments (new processes, socket families, types and protocols, personality). Calls that Docker allows
only with a capability (mount, bpf, perf_event_open, ptrace, ...) or that it leaves out
(keyctl, add_key, request_key, userfaultfd, ...) are refused, since nothing adds them.

libseccomp (the library behind Docker's, systemd's and bubblewrap's filters) resolves names to
each architecture's numbers and writes the BPF, including the checks that refuse the other
ABIs a 64-bit kernel accepts (i386 via int 0x80, x32). Python reaches it through pyseccomp
(ctypes, the same API as libseccomp's own bindings, which are not on PyPI).
"""

from __future__ import annotations

import errno
import functools
import platform
import tempfile

# Docker's default profile, unconditional allow list (361 names), as published.
DOCKER_DEFAULT_ALLOWED = frozenset("""
accept accept4 access adjtimex alarm bind brk cachestat capget capset chdir chmod chown chown32
clock_adjtime clock_adjtime64 clock_getres clock_getres_time64 clock_gettime clock_gettime64
clock_nanosleep clock_nanosleep_time64 close close_range connect copy_file_range creat dup dup2
dup3 epoll_create epoll_create1 epoll_ctl epoll_ctl_old epoll_pwait epoll_pwait2 epoll_wait
epoll_wait_old eventfd eventfd2 execve execveat exit exit_group faccessat faccessat2 fadvise64
fadvise64_64 fallocate fanotify_mark fchdir fchmod fchmodat fchmodat2 fchown fchown32 fchownat
fcntl fcntl64 fdatasync fgetxattr flistxattr flock fork fremovexattr fsetxattr fstat fstat64
fstatat64 fstatfs fstatfs64 fsync ftruncate ftruncate64 futex futex_requeue futex_time64
futex_wait futex_waitv futex_wake futimesat getcpu getcwd getdents getdents64 getegid getegid32
geteuid geteuid32 getgid getgid32 getgroups getgroups32 getitimer getpeername getpgid getpgrp
getpid getppid getpriority getrandom getresgid getresgid32 getresuid getresuid32 getrlimit
get_robust_list getrusage getsid getsockname getsockopt get_thread_area gettid gettimeofday
getuid getuid32 getxattr getxattrat inotify_add_watch inotify_init inotify_init1
inotify_rm_watch io_cancel ioctl io_destroy io_getevents io_pgetevents io_pgetevents_time64
ioprio_get ioprio_set io_setup io_submit ipc kill landlock_add_rule landlock_create_ruleset
landlock_restrict_self lchown lchown32 lgetxattr link linkat listen listmount listxattr
listxattrat llistxattr _llseek lremovexattr lseek lsetxattr lstat lstat64 madvise
map_shadow_stack membarrier memfd_create memfd_secret mincore mkdir mkdirat mknod mknodat mlock
mlock2 mlockall mmap mmap2 mprotect mq_getsetattr mq_notify mq_open mq_timedreceive
mq_timedreceive_time64 mq_timedsend mq_timedsend_time64 mq_unlink mremap mseal msgctl msgget
msgrcv msgsnd msync munlock munlockall munmap name_to_handle_at nanosleep newfstatat _newselect
open openat openat2 pause pidfd_open pidfd_send_signal pipe pipe2 pkey_alloc pkey_free
pkey_mprotect poll ppoll ppoll_time64 prctl pread64 preadv preadv2 prlimit64 process_mrelease
pselect6 pselect6_time64 pwrite64 pwritev pwritev2 read readahead readlink readlinkat readv recv
recvfrom recvmmsg recvmmsg_time64 recvmsg remap_file_pages removexattr removexattrat rename
renameat renameat2 restart_syscall riscv_hwprobe rmdir rseq rt_sigaction rt_sigpending
rt_sigprocmask rt_sigqueueinfo rt_sigreturn rt_sigsuspend rt_sigtimedwait
rt_sigtimedwait_time64 rt_tgsigqueueinfo sched_getaffinity sched_getattr sched_getparam
sched_get_priority_max sched_get_priority_min sched_getscheduler sched_rr_get_interval
sched_rr_get_interval_time64 sched_setaffinity sched_setattr sched_setparam sched_setscheduler
sched_yield seccomp select semctl semget semop semtimedop semtimedop_time64 send sendfile
sendfile64 sendmmsg sendmsg sendto setfsgid setfsgid32 setfsuid setfsuid32 setgid setgid32
setgroups setgroups32 setitimer setpgid setpriority setregid setregid32 setresgid setresgid32
setresuid setresuid32 setreuid setreuid32 setrlimit set_robust_list setsid setsockopt
set_thread_area set_tid_address setuid setuid32 setxattr setxattrat shmat shmctl shmdt shmget
shutdown sigaltstack signalfd signalfd4 sigprocmask sigreturn socketcall socketpair splice stat
stat64 statfs statfs64 statmount statx symlink symlinkat sync sync_file_range syncfs sysinfo tee
tgkill time timer_create timer_delete timer_getoverrun timer_gettime timer_gettime64
timer_settime timer_settime64 timerfd_create timerfd_gettime timerfd_gettime64 timerfd_settime
timerfd_settime64 times tkill truncate truncate64 ugetrlimit umask uname unlink unlinkat
uretprobe utime utimensat utimensat_time64 utimes vfork vmsplice wait4 waitid waitpid write
writev
""".split())

_IPC = ("ipc shmat shmctl shmdt shmget msgctl msgget msgrcv msgsnd semctl semget semop semtimedop "
        "semtimedop_time64 mq_getsetattr mq_notify mq_open mq_timedreceive mq_timedreceive_time64 "
        "mq_timedsend mq_timedsend_time64 mq_unlink")
# What the sandbox takes out of Docker's list, and why.
REMOVED = {
    **dict.fromkeys(["fork", "vfork"], "no new processes: threads only (clone is narrowed below)"),
    **dict.fromkeys("io_setup io_submit io_cancel io_destroy io_getevents io_pgetevents io_pgetevents_time64".split(),
                    "kernel AIO: not needed"),
    **dict.fromkeys(["memfd_create", "memfd_secret"], "memory outside the address-space limit and the tmpfs"),
    **dict.fromkeys(_IPC.split(), "SysV and POSIX IPC: memory outside the limits, not needed"),
    **dict.fromkeys("mlock mlock2 mlockall munlock munlockall".split(), "pinning memory: not needed"),
    "name_to_handle_at": "file handles (with open_by_handle_at, a known container escape): not needed",
    "fanotify_mark": "fanotify: not needed (fanotify_init is refused anyway)",
    **dict.fromkeys("adjtimex clock_adjtime clock_adjtime64".split(), "the host's clock: not needed"),
    "socketcall": "a multiplexer whose arguments a filter cannot read (32-bit ABIs): socket is narrowed",
    "socketpair": "narrowed below, to AF_UNIX",
    **dict.fromkeys(["vmsplice", "splice", "tee"],
                    "pipes holding references to pages: a vmspliced 4 KiB piece keeps its whole 2 MiB huge page, "
                    "memory no limit counts"),
    "fallocate": "disk blocks beyond a file's size, which RLIMIT_FSIZE does not see (FALLOC_FL_KEEP_SIZE)",
}

# Allowed only for some arguments (argument index, comparison, values); the rest refused.
CLONE_THREAD = 0x00010000
# (family, type, protocol): AF_UNIX (1) stream, datagram and seqpacket; AF_INET (2) and AF_INET6
# (10) TCP and UDP, protocol 0 or named (6, 17); a network namespace confines IP. The type is
# compared in its low bits (the high ones are flags). Nothing else: not SOCK_PACKET or SOCK_RAW,
# and no other protocol, since the kernel loads a protocol's module on demand (SCTP, L2TP,
# MPTCP and UDP-Lite sockets passed a family-and-type filter). Each rule allows one exact value:
# a value with high bits set, which the kernel would truncate to an int, matches none.
SOCKETS = [(1, kind, 0) for kind in (1, 2, 5)] + [
    (family, kind, protocol) for family in (2, 10) for kind, protocols in ((1, (0, 6)), (2, (0, 17))) for protocol in protocols]
PERSONALITIES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)  # Docker's: PER_LINUX and flags, and query
ARCH_ONLY = {"x86_64": ("arch_prctl",)}  # Docker allows it on amd64: threads' TLS needs it
ARCHES = {"x86_64": "X86_64", "aarch64": "AARCH64"}  # where the argument rules below hold (s390 orders clone's otherwise)


def allowed_names() -> frozenset[str]:
    return DOCKER_DEFAULT_ALLOWED - REMOVED.keys()


def _bindings():
    """libseccomp's Python API: its own bindings where installed, else pyseccomp (the same API)."""
    try:
        import seccomp  # type: ignore[import-not-found]
    except ImportError:
        import pyseccomp as seccomp  # raises RuntimeError when libseccomp itself is missing
    return seccomp


def build(machine: str | None = None) -> bytes:
    """The filter as BPF for bubblewrap's --seccomp, for `machine` (default: this one).
    Raises RuntimeError when libseccomp is missing or the architecture has no rules here."""
    with tempfile.TemporaryFile() as out:
        make_filter(machine).export_bpf(out)
        out.seek(0)
        return out.read()


def make_filter(machine: str | None = None):
    """The filter as libseccomp's object (export_bpf, export_pfc), for `machine`."""
    machine = machine or platform.machine()
    if machine not in ARCHES:
        raise RuntimeError(f"no seccomp rules are written for this architecture ({machine})")
    sc = _bindings()
    refused = sc.ERRNO(errno.EPERM)
    flt = sc.SyscallFilter(defaction=refused)
    flt.set_attr(sc.Attr.ACT_BADARCH, refused)  # syscalls of another ABI
    arch = getattr(sc.Arch, ARCHES[machine])
    if sc.system_arch() != arch:  # a filter for another machine (tests write both)
        flt.add_arch(arch)
        flt.remove_arch(sc.Arch.NATIVE)
    for name in sorted(allowed_names() | set(ARCH_ONLY.get(machine, ()))):
        # A call newer than this libseccomp is left out, so refused: no libc here makes it either.
        if sc.resolve_syscall(arch, name) != -1:
            flt.add_rule(sc.ALLOW, name)
    flt.add_rule(sc.ALLOW, "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_THREAD, CLONE_THREAD))
    # clone3's flags sit in memory a filter cannot read: ENOSYS makes libc fall back to clone.
    flt.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
    for family, kind, protocol in SOCKETS:
        flt.add_rule(sc.ALLOW, "socket", sc.Arg(0, sc.EQ, family), sc.Arg(1, sc.MASKED_EQ, 0xF, kind),
                     sc.Arg(2, sc.EQ, protocol))
    # A pair of connected sockets: Unix ones only (another family's creation code, AF_TIPC's,
    # would load its kernel module on demand).
    flt.add_rule(sc.ALLOW, "socketpair", sc.Arg(0, sc.EQ, 1))
    for persona in PERSONALITIES:
        flt.add_rule(sc.ALLOW, "personality", sc.Arg(0, sc.EQ, persona))
    return flt


@functools.lru_cache(maxsize=None)
def native_filter() -> tuple[bytes | None, str | None]:
    """(this machine's filter, None), or (None, why there is none)."""
    if platform.machine() not in ARCHES:
        return None, f"no seccomp rules are written for this architecture ({platform.machine()})"
    try:
        return build(), None
    except (RuntimeError, OSError, AttributeError) as err:  # AttributeError: a libseccomp too old for the binding
        return None, f"libseccomp is not usable here ({err}; apt install libseccomp2)"

