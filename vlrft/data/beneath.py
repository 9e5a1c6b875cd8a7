"""Open a file beneath a directory without following symbolic links.

A path checked by name stays checked only until the tree changes: a media file replaced by a
symlink after the check would otherwise be read from wherever the link points. So a file is
opened relative to a descriptor of its root with no symlink allowed on the way, and read from
that descriptor:
- `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` where the kernel has it (Linux 5.6+); Python
  has no wrapper, so it is called through libc's `syscall` with the architecture's number;
- otherwise (an older kernel, or a seccomp profile that refuses the call) one `openat` per
  path component from the root's descriptor, each with `O_NOFOLLOW`.
Either way only a regular file opens: a FIFO or device swapped in is refused without blocking.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import platform
import stat

RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
# openat2's number: one for every architecture on the unified system call table (Linux 5.1+).
# Architectures with offset tables (alpha, mips, ia64) are left out: they use the walk.
OPENAT2_NUMBERS = {machine: 437 for machine in (
    "x86_64", "amd64", "i386", "i686", "aarch64", "arm64", "armv7l", "armv8l", "riscv64",
    "ppc64", "ppc64le", "s390x", "loongarch64")}
# The kernel asks for a retry when a rename raced the lookup.
OPENAT2_RETRIES = 8


class OpenHow(ctypes.Structure):
    """struct open_how (linux/openat2.h)."""
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _libc_syscall():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    call = libc.syscall
    call.restype = ctypes.c_long
    return call


_SYSCALL = _libc_syscall()
_openat2_state = {"usable": OPENAT2_NUMBERS.get(platform.machine()) is not None and _SYSCALL is not None}


def openat2_usable() -> bool:
    """Whether the last open went through openat2 (false once the kernel refused the call)."""
    return _openat2_state["usable"]


def _openat2(dir_fd: int, relative: str, flags: int) -> int | None:
    """A descriptor from openat2 beneath `dir_fd` with no symlinks; None when the kernel (or a
    seccomp profile) does not offer the call."""
    how = OpenHow(flags | os.O_CLOEXEC, 0, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)
    number = OPENAT2_NUMBERS[platform.machine()]
    for _ in range(OPENAT2_RETRIES):
        fd = _SYSCALL(ctypes.c_long(number), ctypes.c_int(dir_fd), ctypes.c_char_p(os.fsencode(relative)),
                      ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
        if fd >= 0:
            return fd
        code = ctypes.get_errno()
        if code in (errno.ENOSYS, errno.EPERM):  # no such call here, or seccomp refuses it
            _openat2_state["usable"] = False
            return None
        if code != errno.EAGAIN:
            raise OSError(code, os.strerror(code), relative)
    raise OSError(errno.EAGAIN, os.strerror(errno.EAGAIN), relative)


def _walk(dir_fd: int, relative: str, flags: int) -> int:
    """The same open as `_openat2`, one component at a time: each directory with
    O_DIRECTORY | O_NOFOLLOW from its parent's descriptor, the last component with O_NOFOLLOW."""
    names = relative.split("/")
    if any(name in ("", ".", "..") for name in names):
        raise OSError(errno.EXDEV, "path leaves the root or is not normalised", relative)
    fd = os.dup(dir_fd)
    try:
        for name in names[:-1]:
            parent, fd = fd, -1
            try:
                fd = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
            except NotADirectoryError:  # a symlink opened with O_NOFOLLOW | O_DIRECTORY
                raise OSError(errno.ELOOP, "a symbolic link or not a directory", relative) from None
            finally:
                os.close(parent)
        parent, fd = fd, -1
        try:
            return os.open(names[-1], flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        finally:
            os.close(parent)
    finally:
        if fd >= 0:
            os.close(fd)


def _open_under(dir_fd: int, relative: str, flags: int) -> int:
    if _openat2_state["usable"]:
        fd = _openat2(dir_fd, relative, flags)
        if fd is not None:
            return fd
    return _walk(dir_fd, relative, flags)


def open_beneath(root: str, relative: str) -> int:
    """A read-only descriptor of the regular file `relative` beneath the directory `root` (an
    absolute path without symlinks, itself opened from "/" under the same rule). Raises OSError
    (ELOOP for a symlink on the way, EXDEV for a path leaving the root, EINVAL for anything
    but a regular file)."""
    if not os.path.isabs(root):
        raise OSError(errno.EINVAL, "the root must be an absolute path", root)
    if "\0" in root or "\0" in relative:  # C would read the name only up to it
        raise ValueError("embedded null byte")
    slash = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        inner = root.strip("/")
        root_fd = _open_under(slash, inner, os.O_PATH | os.O_DIRECTORY) if inner else os.dup(slash)
    finally:
        os.close(slash)
    try:
        # O_NONBLOCK: a FIFO put in the file's place must not hang the open.
        fd = _open_under(root_fd, relative, os.O_RDONLY | os.O_NONBLOCK)
    finally:
        os.close(root_fd)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", relative)
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return fd
