"""The trusted parent of one sandbox: ``python -m multihead.grader.warden LOG MEMORY CPU PROCS -- ARGV...``.

Standard library only; it never imports the submission. It makes itself a *child subreaper* (Linux
``prctl``), so every process the submission starts -- a fork bomb, a daemon that double-forks into
a new session -- stays its descendant; starts ARGV (the sandbox) in a new session under resource
limits (address space MEMORY bytes, CPU seconds, open files; processes where the kernel enforces it);
keeps the first 64 KiB of what the sandbox prints (the rest is read and dropped) into LOG; kills the
whole tree when the sandbox ends, when more than PROCS processes exist, or when it is told to stop
(SIGTERM from the grader); and exits 0, writing a last line ``{"status": ...}`` to LOG's companion
``LOG.status`` for the grader: the sandbox's exit code or signal, and why it was stopped.
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
        while True:  # reap what died (we are their subreaper)
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                break
        if not pids:
            return
        time.sleep(0.01)


def _limits(memory: int, cpu: int) -> None:
    """In the sandbox, before exec: its own session, and the resource limits."""
    os.setsid()
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 2))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if os.geteuid() != 0:  # not enforced for root; the warden's count catches a fork bomb there
        soft, hard = resource.getrlimit(resource.RLIMIT_NPROC)
        resource.setrlimit(resource.RLIMIT_NPROC, (min(512, hard if hard > 0 else 512),) * 2)


def main(argv: list[str]) -> int:
    log, memory, cpu, procs = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    cmd = argv[argv.index("--") + 1:]
    me = os.getpid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the session kill still applies
        pass
    stop = {"why": None}
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("why", "stopped by the grader"))
    r, w = os.pipe()
    fds = [int(x) for x in os.environ.get("MULTIHEAD_SANDBOX_FDS", "").split(",") if x]
    child = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=w, stderr=w, pass_fds=fds,
                             preexec_fn=lambda: _limits(memory, cpu), close_fds=True)
    os.close(w)
    for fd in fds:
        os.close(fd)
    kept, dropped, status = bytearray(), 0, None
    while status is None:
        ready = select.select([r], [], [], 0.02)[0]
        if ready:
            b = os.read(r, 65536)
            if b:
                room = CAP - len(kept)
                kept += b[:max(room, 0)]
                dropped += max(len(b) - max(room, 0), 0)
        code = child.poll()
        if code is not None:
            status = {"exit": code}
        elif stop["why"] is not None:
            status = {"exit": None, "why": stop["why"]}
        elif len(_descendants(me)) > procs:
            status = {"exit": None, "why": f"started more than {procs} processes"}
    _kill_tree(me, child.pid)
    try:
        child.wait(timeout=1)
    except subprocess.TimeoutExpired:
        pass
    while select.select([r], [], [], 0)[0]:  # what was printed last, now that every writer is gone
        b = os.read(r, 65536)
        if not b:
            break
        room = CAP - len(kept)
        kept += b[:max(room, 0)]
        dropped += max(len(b) - max(room, 0), 0)
    if status.get("exit") is None and child.returncode is not None:
        status["signal"] = -child.returncode if child.returncode < 0 else None
    if dropped:
        kept += f"\n[... {dropped} more bytes of output dropped]\n".encode()
    with open(log, "wb") as f:
        f.write(bytes(kept))
    with open(log + ".status", "w") as f:
        f.write(json.dumps(status))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
