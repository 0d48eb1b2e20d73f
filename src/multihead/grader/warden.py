"""The trusted parent of one sandbox. It never imports the submission. It makes itself a *child
subreaper* (Linux ``prctl``), so every process the submission starts -- a fork bomb, a daemon that
double-forks into a new session -- stays its descendant; starts the sandbox in a new session under
resource limits (address space, CPU seconds; processes where the kernel enforces it); keeps the first
64 KiB of what the sandbox prints (the rest is read and dropped); kills the whole tree when the
sandbox ends, when more than a set number of processes exist, or when it is told to stop (SIGTERM
from the grader); and writes LOG (the output) and LOG.status (``{"exit": code}`` or
``{"exit": null, "why": ...}``) for the grader.

Two ways in: ``python -m multihead.grader.warden LOG MEMORY CPU PROCS -- ARGV...`` (the sandbox is a
fresh ``python -m multihead.grader.sandbox``), or :func:`forked` in a process forked from the grader's
fork server (:mod:`multihead.grader.zygote`), where the sandbox is a fork that already holds torch.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import select
import signal
import subprocess
import sys
import time

CAP = 64 * 1024
PR_SET_CHILD_SUBREAPER = 36


def _descendants(root: int) -> list[int]:
    """Every process whose parent chain reaches ``root`` (read from /proc)."""
    parent = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
            parent[int(d)] = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    kids: dict[int, list[int]] = {}
    for pid, pp in parent.items():
        kids.setdefault(pp, []).append(pid)
    out, todo = [], [root]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def reap() -> bool:
    """Collect every child that has ended; False when no child is left."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True


def _kill_tree(me: int, sid: int | None) -> None:
    """SIGKILL the sandbox's session and every descendant, until none is left (or 2 s)."""
    end = time.monotonic() + 2.0
    while time.monotonic() < end:
        if sid is not None:
            try:
                os.killpg(sid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        pids = _descendants(me)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if not reap():  # what died (we are their subreaper); no child left: done
            return
        if not pids:
            return
        time.sleep(0.01)


def limits(memory: int, cpu: int) -> None:
    """In the sandbox, before it runs anything of the submission: its own session, the resource limits."""
    os.setsid()
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 2))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if os.geteuid() != 0:  # not enforced for root; the warden's count catches a fork bomb there
        soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
        resource.setrlimit(resource.RLIMIT_NPROC, (min(512, hard if hard > 0 else 512),) * 2)


def subreaper() -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the session kill still applies
        pass


class _Output:
    """The sandbox's output: the first CAP bytes kept, the rest counted."""

    def __init__(self, fd: int):
        self.fd, self.kept, self.dropped = fd, bytearray(), 0

    def read(self, timeout: float) -> None:
        while select.select([self.fd], [], [], timeout)[0]:
            b = os.read(self.fd, 65536)
            if not b:
                return
            room = max(CAP - len(self.kept), 0)
            self.kept += b[:room]
            self.dropped += max(len(b) - room, 0)
            timeout = 0

    def text(self) -> bytes:
        return bytes(self.kept) + (f"\n[... {self.dropped} more bytes of output dropped]\n".encode()
                                   if self.dropped else b"")


def supervise(child: int, out: _Output, procs: int, log: str) -> None:
    """Watch the sandbox ``child`` until it ends, is stopped or starts too many processes; kill the tree;
    write LOG and LOG.status."""
    me = os.getpid()
    stop = {"why": None}
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("why", "stopped by the grader"))
    status = None
    while status is None:
        out.read(0.02)
        pid, code = os.waitpid(child, os.WNOHANG)
        if pid == child:
            status = {"exit": os.waitstatus_to_exitcode(code)}
        elif stop["why"] is not None:
            status = {"exit": None, "why": stop["why"]}
        elif len(_descendants(me)) > procs:
            status = {"exit": None, "why": f"started more than {procs} processes"}
    _kill_tree(me, child)
    out.read(0)  # what was printed last, now that every writer is gone
    with open(log, "wb") as f:
        f.write(out.text())
    with open(log + ".status.part", "w") as f:  # renamed when whole: a grader polling for the file never
        f.write(json.dumps(status))              # reads it half-written (it read {} once: "exit code None")
    os.replace(log + ".status.part", log + ".status")


def _close_all_but(keep: tuple[int, ...]) -> None:
    lo = 3
    for fd in sorted(keep):
        os.closerange(lo, fd)
        lo = fd + 1
    os.closerange(lo, 65536)


def forked(log: str, memory: int, cpu: int, procs: int, keep: tuple[int, ...], serve) -> None:
    """In a process forked from the fork server: become the warden of a sandbox that is a fork of this
    process (``serve()`` runs there after the limits; ``keep``: the descriptors it may use) and exit."""
    subreaper()
    r, w = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            os.close(r)
            limits(memory, cpu)
            os.dup2(w, 1)
            os.dup2(w, 2)
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, 0)
            _close_all_but(keep)  # nothing of the fork server's but its own pipes
            serve()
        finally:
            os._exit(0)
    os.close(w)
    for fd in keep:
        os.close(fd)
    supervise(child, _Output(r), procs, log)
    os._exit(0)


def main(argv: list[str]) -> int:
    log, memory, cpu, procs = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    cmd = argv[argv.index("--") + 1:]
    subreaper()
    r, w = os.pipe()
    fds = [int(x) for x in os.environ.get("MULTIHEAD_SANDBOX_FDS", "").split(",") if x]
    child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=w, stderr=w, pass_fds=fds,
                             preexec_fn=lambda: limits(memory, cpu), close_fds=True)
    os.close(w)
    for fd in fds:
        os.close(fd)
    supervise(child.pid, _Output(r), procs, log)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
