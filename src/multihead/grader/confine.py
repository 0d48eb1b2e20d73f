"""What a submission's process may touch, as an allow-list: applied by the sandbox to itself (and so to
everything it starts) after it has imported what it needs and before it imports the learner's file.

- **Files** (Linux's Landlock, kernel 5.13+): it may read only the Python installation and its packages
  (:func:`readable`: the interpreter's prefixes, the import path's folders but the working directory, the
  system's libraries) and its own folder under ``/proc``; it may read and write only its scratch folder (where
  the grader put its source: the file is handed to it, never found by path) and ``/dev/null``. A classmate's
  file -- by absolute path, by a glob of the working directory, through ``/proc/<parent>/cwd`` -- and any other
  process's ``/proc`` entries (the grader's command line) are refused by the kernel (``PermissionError``).
- **Network**: a network namespace of its own (``unshare``, in a user namespace of its own: even a grader running
  as root leaves it no capability over the machine), so no address of any protocol leads anywhere, and no socket
  of any family can be made (a seccomp filter refuses ``socket`` and ``io_uring_setup``): no UDP, no TCP, no Unix
  socket, abstract or by path. The same filter refuses what changes a file's mode, owner, times or extended
  attributes (which Landlock does not cover).
- **Other processes**: Landlock's scopes (ABI 6) refuse signals to, and abstract sockets of, processes outside
  the sandbox; Landlock already refuses ptrace (and so ``/proc/<pid>/mem``) of them; SysV IPC gets a namespace
  of its own.
- **A user of its own** where the namespaces are refused (inside Docker, whose default seccomp profile refuses
  ``unshare``: Gradescope's, PrairieLearn's and GitHub's graders run there) and the grader is root: the process
  becomes an unprivileged user of its own (uid :data:`UID_BASE` + its pid, no groups), its scratch folder handed to
  that user, after Landlock and the seccomp filter are in place; root's files, the grader's processes and every
  other sandbox are then another user's. That user imports from the Python the grader runs, so every user must be
  able to read it (:func:`unreadable` says where one cannot: a virtual environment under ``/root``; the grader then
  refuses to start, naming the path).

Each layer is a kernel mechanism made for this, called through ``ctypes`` (``syscall`` numbers of x86-64 and
arm64). :func:`unconfined` says, in words, what this machine cannot confine (the grader prints it once);
:func:`confine` applies what it can and returns the same list.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import resource
import site
import struct
import sys

__all__ = ["UID_BASE", "abi", "confine", "installation", "readable", "unconfined", "unreadable"]

#: the first uid of the users a sandbox becomes where it has no user namespace and the grader is root (+ its pid:
#: one user per live sandbox; no account needed)
UID_BASE = 1_900_000_000

#: (create_ruleset, add_rule, restrict_self) by machine: the same numbers on every 64-bit Linux ABI but alpha
_CALLS = {"x86_64": (444, 445, 446), "aarch64": (444, 445, 446), "arm64": (444, 445, 446)}
#: the seccomp filter's system calls by machine: (AUDIT_ARCH, refused with EACCES: socket, io_uring_setup; refused
#: with EPERM: what changes a file's metadata, which Landlock does not cover -- chmod, chown, utime, xattrs)
_SECCOMP = {
    "x86_64": (0xC000003E, (41, 425), (90, 91, 268, 452, 92, 93, 94, 260, 132, 235, 261, 280, 188, 189, 190, 197, 198,
                                       199, 463, 466)),
    "aarch64": (0xC00000B7, (198, 425), (52, 53, 452, 54, 55, 88, 5, 6, 7, 14, 15, 16, 463, 466)),
}
_SECCOMP["arm64"] = _SECCOMP["aarch64"]
#: truncate(2) by path, refused by the filter where Landlock is older than ABI 3 (which handles it)
_TRUNCATE_NR = {"x86_64": 76, "aarch64": 45, "arm64": 45}
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2
_CLONE_NEWIPC, _CLONE_NEWUSER, _CLONE_NEWNET = 0x08000000, 0x10000000, 0x40000000
_RULE_PATH_BENEATH = 1
_EXECUTE, _WRITE_FILE, _READ_FILE, _READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_CHANGE = sum(1 << b for b in range(4, 13))  # remove, make (char, dir, reg, sock, fifo, block, sym)
_REFER, _TRUNCATE = 1 << 13, 1 << 14  # ABI 2, ABI 3
_FILE_RIGHTS = _EXECUTE | _WRITE_FILE | _READ_FILE | _TRUNCATE  # the rights a rule on a file (not a folder) may hold
_BIND_TCP, _CONNECT_TCP = 1 << 0, 1 << 1  # ABI 4 (network)
_SCOPE_ABSTRACT_UNIX, _SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6
_READ = _EXECUTE | _READ_FILE | _READ_DIR


class _Ruleset(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _fail(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


def abi() -> int:
    """The kernel's Landlock ABI version (0: none, or not a Linux machine this module knows)."""
    calls = _CALLS.get(platform.machine())
    if calls is None or os.name != "posix":
        return 0
    version = _libc().syscall(calls[0], None, ctypes.c_size_t(0), ctypes.c_uint32(1))  # LANDLOCK_CREATE_RULESET_VERSION
    return max(int(version), 0)


def readable(exclude: tuple[str, ...] = ()) -> list[str]:
    """The folders a submission's process may read: the interpreter's prefixes (the virtual environment and the
    Python it was made from), the import path's folders that lie inside them, multihead's own package folder (an
    editable install's source), the system's libraries (``/usr``, ``/lib``: what a C extension loads). Never ``/``,
    the working directory or a folder above it, nor a folder holding anything in ``exclude`` (the submissions): a
    class kept beside the code stays unread. Call it before changing the working directory."""
    cwd = os.path.realpath(os.getcwd())
    prefixes = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    inside = [p for p in sys.path if p and any(_under(os.path.realpath(p), pre) for pre in prefixes)]
    places = {*prefixes, *site.getsitepackages(), *inside, "/usr", "/lib", "/lib64", "/bin", "/etc/ld.so.cache",
              os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}  # multihead's package folder
    out = []
    for p in sorted(places):
        real = os.path.realpath(p)
        if real == "/" or not os.path.exists(real) or real in out:
            continue
        if any(_under(e, real) for e in (cwd, *(os.path.realpath(os.path.abspath(x)) for x in exclude))):
            continue  # the working directory or a folder above it, or a folder holding a submission
        out.append(real)
    return out


def installation() -> list[str]:
    """What a submission's process reads of the Python the grader runs, by path: the interpreter, its prefixes (the
    virtual environment and the Python it was made from), the standard library, the import path's folders inside
    them, the site-packages, torch's and multihead's package folders."""
    import importlib.util

    places = [sys.executable, sys.prefix, sys.base_prefix, os.path.dirname(os.__file__), *site.getsitepackages(),
              os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
    prefixes = [os.path.realpath(p) for p in (sys.prefix, sys.base_prefix)]
    places += [p for p in sys.path if p and any(_under(os.path.realpath(p), pre) for pre in prefixes)]
    torch = importlib.util.find_spec("torch")
    if torch is not None and torch.origin:
        places.append(os.path.dirname(torch.origin))
    out = []
    for p in places:
        if os.path.exists(p) and os.path.realpath(p) not in out:
            out.append(os.path.realpath(p))
    return out


def unreadable(paths: list[str] | None = None) -> list[str]:
    """Where another user -- a submission's user of its own (:func:`confine`, where the grader is root and user
    namespaces are refused) -- cannot read ``paths`` (default: :func:`installation`), by their modes: a folder
    above one that others may not pass through, the path itself or an entry right inside it (a folder's) that
    others may not read (and pass through: a folder; run: the interpreter). Each as "PATH (mode 0700: why)"; empty:
    every user can read them. Mode bits only (an access-control list is not read)."""
    import stat
    from pathlib import Path

    paths = installation() if paths is None else [os.path.realpath(p) for p in paths]
    found: list[str] = []

    def need(path: str, bits: int, why: str) -> bool:
        try:
            mode = os.lstat(path).st_mode
        except OSError:
            return True
        if stat.S_ISLNK(mode) or mode & bits == bits:
            return True
        said = f"{path} (mode {stat.S_IMODE(mode):04o}: {why})"
        if said not in found:
            found.append(said)
        return False

    for path in paths:
        folders = [str(f) for f in reversed(Path(path).parents)]  # /, /a, /a/b for /a/b/c
        if not all(need(f, stat.S_IXOTH, "others cannot pass through it") for f in folders):
            continue
        if not os.path.isdir(path):
            run = stat.S_IXOTH if path == os.path.realpath(sys.executable) else 0
            need(path, stat.S_IROTH | run, "others cannot read" + (" and run it" if run else " it"))
            continue
        if not need(path, stat.S_IROTH | stat.S_IXOTH, "others cannot list it or pass through it"):
            continue
        with os.scandir(path) as entries:
            for e in entries:
                if e.is_dir(follow_symlinks=False):
                    need(e.path, stat.S_IROTH | stat.S_IXOTH, "others cannot list it or pass through it")
                elif e.is_file(follow_symlinks=False):
                    need(e.path, stat.S_IROTH, "others cannot read it")
    return found


def _under(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or lies inside it (both real, absolute)."""
    return os.path.commonpath([path, folder]) == folder


def _landlock(version: int, scratch: str, read: list[str]) -> None:
    create, add_rule, restrict = _CALLS[platform.machine()]
    libc = _libc()
    fs = _READ | _WRITE_FILE | _CHANGE | (_REFER if version >= 2 else 0) | (_TRUNCATE if version >= 3 else 0)
    net = (_BIND_TCP | _CONNECT_TCP) if version >= 4 else 0
    scoped = (_SCOPE_ABSTRACT_UNIX | _SCOPE_SIGNAL) if version >= 6 else 0
    attr = _Ruleset(fs, net, scoped)
    size = 24 if version >= 6 else 16 if version >= 4 else 8  # the fields this ABI knows
    ruleset = libc.syscall(create, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        raise _fail("landlock_create_ruleset")
    rules = [(p, _READ) for p in read] + [(f"/proc/{os.getpid()}", _READ), (scratch, fs), ("/dev/null", fs),
                                          ("/dev/urandom", _READ), ("/dev/zero", _READ),
                                          ("/proc/cpuinfo", _READ), ("/sys/devices/system/cpu", _READ)]  # the CPU
    try:
        for path, rights in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # not on this machine
            try:
                if not os.path.isdir(path):
                    rights &= _FILE_RIGHTS
                rule = _PathBeneath(rights & fs, fd)
                if libc.syscall(add_rule, ruleset, _RULE_PATH_BENEATH, ctypes.byref(rule), ctypes.c_uint32(0)) < 0:
                    raise _fail(f"landlock_add_rule({path})")
            finally:
                os.close(fd)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0 or libc.syscall(restrict, ruleset, ctypes.c_uint32(0)) < 0:
            raise _fail("landlock_restrict_self")
    finally:
        os.close(ruleset)


def _no_network() -> None:
    """A network namespace (and a SysV IPC one) of this process's own: only a loopback device, down."""
    flags = _CLONE_NEWUSER | _CLONE_NEWNET | _CLONE_NEWIPC  # a user namespace even for root: no capability outside
    if _libc().unshare(flags) < 0:
        raise _fail("unshare")


def _no_sockets(version: int) -> None:
    """A seccomp filter: ``socket`` and ``io_uring_setup`` fail with EACCES (no socket of any family, IP, Unix,
    netlink); changing a file's mode, owner, times or extended attributes fails with EPERM (Landlock does not cover
    them), and so does ``truncate`` where Landlock (``version``) does not; another system-call ABI (x32) is refused,
    another architecture (i386) ends the process."""
    arch, sockets, metadata = _SECCOMP[platform.machine()]
    if version < 3:
        metadata = (*metadata, _TRUNCATE_NR[platform.machine()])

    def op(code, k, jt=0, jf=0):
        return struct.pack("=HBBI", code, jt, jf, k)

    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    allow, acces, perm, kill = 0x7FFF0000, 0x00050000 | 13, 0x00050000 | 1, 0x80000000  # SECCOMP_RET_*
    checks = [(jge, 0x40000000, "acces")] + [(jeq, nr, "acces") for nr in sockets] + \
        [(jeq, nr, "perm") for nr in metadata]
    head = [op(ld, 4), op(jeq, arch, 1, 0), op(ret, kill), op(ld, 0)]  # seccomp_data.arch, then .nr
    n = len(head) + len(checks)  # the index of "allow"; "acces" and "perm" follow it
    target = {"acces": n + 1, "perm": n + 2}
    body = [op(code, k, target[to] - (len(head) + i) - 1, 0) for i, (code, k, to) in enumerate(checks)]
    prog = b"".join([*head, *body, op(ret, allow), op(ret, acces), op(ret, perm)])
    buf = ctypes.create_string_buffer(prog, len(prog))
    fprog = _SockFprog(len(prog) // 8, ctypes.cast(buf, ctypes.c_void_p))
    libc = _libc()
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0 or \
            libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) < 0:
        raise _fail("seccomp")


def _hand_over(scratch: str, uid: int) -> None:
    """The scratch folder and what is in it (the learner's file) made ``uid``'s: the only place that user owns."""
    for folder, dirs, files in os.walk(scratch):
        for name in (*dirs, *files):
            os.chown(os.path.join(folder, name), uid, uid, follow_symlinks=False)
    os.chown(scratch, uid, uid)


def _become(uid: int) -> None:
    """Become the unprivileged user ``uid`` (and its group, no other group), irreversibly: real, effective and saved
    ids, so nothing can take root back; its process count limited as any user's is."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    resource.setrlimit(resource.RLIMIT_NPROC, (512, 512))


def confine(scratch: str, read: list[str] | None = None, *, active: list[str] | None = None) -> list[str]:
    """Confine this process (and every process it starts), irreversibly: read only ``read`` (default
    :func:`readable`) and the scratch folder, write only the scratch folder, no network, no socket, no signal or
    trace of a process outside; where the namespaces are refused and this process is root, become a user of its own
    (:data:`UID_BASE` + pid). What could not be confined on this machine is returned, in words (empty: all);
    ``active`` (a list) gets the layers that were applied, in words."""
    read = readable() if read is None else read
    active = [] if active is None else active
    missing = []
    if platform.machine() not in _CALLS or os.name != "posix":
        return [_GAPS["files"], _GAPS["network"], _GAPS["processes"]]
    user = None
    try:
        _no_network()
        active.append("user and network namespaces")
    except OSError:
        missing.append(_GAPS["network"])
        if os.geteuid() == 0:  # root without a user namespace: a user of its own instead (the chown precedes seccomp)
            user = UID_BASE + os.getpid()
            _hand_over(scratch, user)
    version = abi()
    if version:
        _landlock(version, scratch, read)
        active.append(f"Landlock (ABI {version})")
        if version < 6:
            missing.append(_GAPS["signals"])
    else:
        missing += [_GAPS["files"], _GAPS["processes"]]
    try:
        _no_sockets(version)
        active.append("seccomp filter")
    except OSError:
        missing.append(_GAPS["sockets"])
    if user is not None:
        _become(user)
        active.append(f"a user of its own (uid {user})")
    return missing


_GAPS = {
    "files": "files (no Landlock: it can read and write whatever the grading user can, a classmate's file included)",
    "network": "the network (no network namespace: it can reach this machine's and others' addresses)",
    "sockets": "sockets and file metadata (no seccomp filter: it can open UDP and Unix sockets, and chmod a "
               "classmate's file)",
    "signals": "signals (Landlock older than ABI 6: it can signal the grader's other processes)",
    "processes": "other processes (it can read their /proc entries)",
}


@functools.cache
def unconfined() -> tuple[str, ...]:
    """What a submission's process would *not* be confined from on this machine, in words (empty: nothing): the
    sandbox's confinement tried once in a throw-away child process."""
    if os.name != "posix" or not hasattr(os, "fork"):
        return (_GAPS["files"], _GAPS["network"], _GAPS["processes"])
    import tempfile

    scratch = tempfile.mkdtemp(prefix="multihead-confine-")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: confine, say what was missing, end
        code = 1
        try:
            os.close(r)
            os.write(w, "\n".join(confine(scratch, read=[])).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 4096):
        chunks.append(chunk)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    os.rmdir(scratch)
    if os.waitstatus_to_exitcode(status) != 0:
        return tuple(_GAPS.values())
    return tuple(line for line in b"".join(chunks).decode().split("\n") if line)
