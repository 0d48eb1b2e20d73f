"""What a submission's process may write: nothing outside its own scratch folder (and ``/dev``), through
Linux's Landlock (kernel 5.13 and later), applied by the sandbox to itself before it imports the learner's
file. Reading stays open (the file, Python, torch); writing, creating, removing or renaming files
anywhere else is refused by the kernel (``PermissionError``), and so are TCP connections and
listening sockets where the kernel's Landlock knows them (ABI 4). Without it a submission could
rewrite a classmate's file before that one is graded (its grade became ``SystemExit: pwned``), or
the teacher's files.

Landlock's calls are made with ``ctypes`` (``syscall`` numbers of x86-64 and arm64); a kernel without
it (or another machine) gives :func:`abi` 0, and the grader says so once instead of claiming a
confinement it cannot give.
"""

from __future__ import annotations

import ctypes
import os
import platform

__all__ = ["abi", "confine"]

#: (create_ruleset, add_rule, restrict_self) by machine: the same numbers on every 64-bit Linux ABI but alpha
_CALLS = {"x86_64": (444, 445, 446), "aarch64": (444, 445, 446), "arm64": (444, 445, 446)}
_PR_SET_NO_NEW_PRIVS = 38
_RULE_PATH_BENEATH = 1
# filesystem rights that change something (reading and executing are not handled, so they stay allowed)
_WRITE = (1 << 1) | (1 << 4) | (1 << 5) | (1 << 6) | (1 << 7) | (1 << 8) | (1 << 9) | (1 << 10) | (1 << 11) | (1 << 12)
_REFER, _TRUNCATE = 1 << 13, 1 << 14  # ABI 2, ABI 3
_BIND_TCP, _CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4 (network)


class _Ruleset(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def abi() -> int:
    """The kernel's Landlock ABI version (0: none, or not a Linux machine this module knows)."""
    calls = _CALLS.get(platform.machine())
    if calls is None or os.name != "posix":
        return 0
    version = _libc().syscall(calls[0], None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # LANDLOCK_CREATE_RULESET_VERSION
    return max(int(version), 0)


def confine(writable: list[str]) -> bool:
    """Restrict this process (and every process it starts) to write beneath ``writable`` only, and to no TCP
    connection where the kernel can refuse one. Irreversible. Returns False, changing nothing, where Landlock is
    missing; raises OSError when the kernel refuses a step it advertised."""
    version = abi()
    if not version:
        return False
    create, add_rule, restrict = _CALLS[platform.machine()]
    libc = _libc()
    fs = _WRITE | (_REFER if version >= 2 else 0) | (_TRUNCATE if version >= 3 else 0)
    net = (_BIND_TCP | _CONNECT_TCP) if version >= 4 else 0
    attr = _Ruleset(fs, net)
    size = ctypes.sizeof(_Ruleset) if net else ctypes.sizeof(ctypes.c_uint64)  # ABI < 4: the first field only
    ruleset = libc.syscall(create, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), f"landlock_create_ruleset: {os.strerror(ctypes.get_errno())}")
    try:
        for path in writable:
            fd = os.open(path, os.O_PATH | os.O_DIRECTORY)
            try:
                rule = _PathBeneath(fs, fd)
                if libc.syscall(add_rule, ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule), ctypes.c_uint32(0)) < 0:
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule({path}): {os.strerror(ctypes.get_errno())}")
            finally:
                os.close(fd)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0 or libc.syscall(restrict, ruleset, ctypes.c_uint32(0)) < 0:
            raise OSError(ctypes.get_errno(), f"landlock_restrict_self: {os.strerror(ctypes.get_errno())}")
    finally:
        os.close(ruleset)
    return True
