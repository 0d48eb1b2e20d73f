"""The grader's side of a sandbox: :class:`SandboxSubject` starts the warden (which starts the
submission's process under limits), sends it requests and reads its replies, all before a wall-clock
deadline; :meth:`SandboxSubject.close` ends the whole process tree.

What is isolated: the verdict (computed here, from tensors), the grader's memory (the sandbox has
its own address-space limit), the CPU (a CPU-time limit, one thread), the process table (the warden
kills every descendant at the end, and a tree larger than its limit at once), the output (capped; it
never becomes a row), and the machine (:mod:`multihead.grader.confine`, an allow-list): the submission's
process reads the Python installation and a copy of its own file that this side puts in its scratch folder,
writes only there, and has no network, no socket and no view of another process -- what a machine cannot
confine, :func:`~multihead.grader.confine.unconfined` says and the grader prints once.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import NamedTuple

from multihead.grader import sandbox, wire, zygote
from multihead.grader.report import safe
from multihead.grader.subject import Description, Probe, Reply
from multihead.grader.zygote import ENV_KEPT, environment  # noqa: F401 - ENV_KEPT: documented here

__all__ = ["Limits", "SandboxError", "SandboxSubject", "adopt", "parse_size"]


class Limits(NamedTuple):
    """Per submission: wall-clock seconds, CPU seconds, address space in bytes (beyond the shared libraries torch
    maps: :func:`library_space`), processes."""

    wall: float = 60.0
    cpu: int = 120
    memory: int = 4 << 30
    processes: int = 32


@functools.lru_cache(maxsize=1)
def library_space() -> int:
    """Bytes of address space the shared libraries loaded in this process take (torch's among them: ~3 GB for its
    default build, whose CUDA libraries are mapped even on a CPU), read from /proc/self/maps; 0 where there is none.
    The sandbox maps the same libraries, so its address-space limit is ``Limits.memory`` on top of this: ``memory``
    bounds what the submission allocates, whichever torch build is installed."""
    total = 0
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6 and ".so" in parts[5].rsplit("/", 1)[-1]:
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    total += hi - lo
    except OSError:  # not Linux
        return 0
    return total


def parse_size(text: str) -> int:
    """'4G', '512M', '2GiB', '1000000' -> bytes; a ValueError naming the text otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(i?[bB])?\s*", str(text))
    if m is None:
        raise ValueError(f"--memory must be a size such as 4G, 512M or 2GiB; got {text!r}.")
    n = float(m.group(1)) * 1024 ** " KMGT".index((m.group(2) or " ").upper())
    if n < 64 << 20:
        raise ValueError(f"--memory {text!r} is under 64 MiB: too little for Python and torch to start.")
    return int(n)


class SandboxError(RuntimeError):
    """The submission could not be graded: ``status`` "error" or "timeout", ``finding`` the reason."""

    def __init__(self, status: str, finding: str):
        super().__init__(finding)
        self.status, self.finding = status, finding


class SandboxSubject:
    """One learner's file, in its own process, seen through :meth:`describe` and :meth:`call`."""

    def __init__(self, path: Path, name: str, *, init: dict | None = None, call: str = "qkv", seed: int = 0,
                 limits: Limits | None = None):
        limits = Limits() if limits is None else limits
        self.path, self.name, self.limits = Path(path), name, limits
        self.deadline = time.monotonic() + limits.wall
        self._log_dir = tempfile.mkdtemp(prefix="multihead-sandbox-")
        if os.geteuid() == 0:  # a sandbox that becomes a user of its own (confine) must pass through to its scratch
            os.chmod(self._log_dir, 0o711)  # folder: through, never list nor write (its log stays root's)
        self.log = os.path.join(self._log_dir, "output.txt")
        scratch = os.path.join(self._log_dir, "scratch")  # where the sandbox may write (not the log beside it)
        os.mkdir(scratch)
        shutil.copyfile(self.path, sandbox.handed(scratch, str(self.path)))  # handed over: never read by path there
        # the path absolute: the sandbox excludes its folder from what it may read, wherever the grader runs
        request = {"path": str(self.path.resolve()), "name": name, "init": init or {}, "call": call, "seed": seed,
                   "log": self.log, "memory": limits.memory + library_space(), "cpu": limits.cpu,
                   "processes": limits.processes,
                   "scratch": scratch}
        zygote = _zygote()
        if zygote is not None:
            self._warden, self._req, self._rep = zygote.spawn(request, self.log)
        else:
            self._warden, self._req, self._rep = _exec_warden(request)
        self._closed, self._output, self._status = False, "", {}
        self.ready = self._recv("starting")
        #: the layers confining the submission's process, in words (:func:`multihead.grader.confine.confine`)
        self.layers: list[str] = [safe(x, 100) for x in self.ready[0].get("layers") or []]
        from multihead.grader import confine

        missed = [g for g in self.ready[0].get("unconfined") or [] if g not in confine.unconfined()]
        if missed:  # the sandbox could not confine what this machine can (and the grader said it would)
            self.close(kill=True)
            raise SandboxError("error", f"the submission's process could not be confined from: {'; '.join(missed)}")

    # --- messages ---------------------------------------------------------------------------
    def _recv(self, what: str) -> tuple[dict, dict]:
        try:
            h, t = wire.recv(self._rep, self.deadline)
        except wire.Deadline:
            self.close(kill=True)
            raise SandboxError("timeout", f"no answer within {self.limits.wall:g} s while {what} (an endless loop?)"
                               ) from None
        except wire.Closed:
            self.close()
            raise SandboxError("error", self._ended(what)) from None
        except ValueError as e:
            self.close()
            raise SandboxError("error", f"the submission's process sent a malformed message while {what}: "
                               f"{safe(e, 300)}") from None
        if h.get("ready") is False:
            self.close()
            stage = {"import": f"importing {self.path}", "lookup": "looking the class up",
                     "build": f"building {self.name}"}.get(h.get("stage"), safe(h.get("stage"), 100))
            where = f" ({safe(h['where'], 300)})" if h.get("where") else ""
            msg = safe(h.get("error"))  # the submission's text: escaped and capped before it is shown anywhere
            if h.get("stage") == "lookup":
                raise SandboxError("error", msg)
            if msg.startswith("ModuleNotFoundError: No module named 'd2l'"):  # the course's own helper package
                msg += (" -- the course's d2l package is not installed where the grader runs: install it there, or "
                        "grade a file that defines what it takes from d2l (DotProductAttention, masked_softmax)")
            elif msg.startswith("ModuleNotFoundError: No module named "):
                msg += _missing_module_hint(msg, Path(self.path))
            raise SandboxError("error", f"{stage} failed: {msg}{where}")
        return h, t

    def _send(self, header: dict, tensors: dict | None = None) -> None:
        try:
            wire.send(self._req, header, tensors)
        except (BrokenPipeError, OSError):
            self.close()
            raise SandboxError("error", self._ended("receiving a request")) from None

    def _ended(self, what: str) -> str:
        """Why the process ended, from the warden's status and the last line it printed."""
        status = self.close()
        lines = [ln for ln in self._output.splitlines() if ln.strip()]
        tail = f": {safe(lines[-1], 300)}" if lines else ""
        if status.get("why"):
            return f"the submission's process was stopped while {what}: {status['why']}"
        code = status.get("exit")
        how = {-9: " (killed: over its memory or process limit?)", -24: " (over its CPU-time limit)"}.get(code, "")
        return f"the submission's process ended while {what}, exit code {code}{how}{tail}"

    # --- the subject ------------------------------------------------------------------------
    def describe(self) -> Description:
        self._send({"op": "describe"})
        return wire.description_in(*self._recv("describing the module"))

    def call(self, probe: Probe) -> Reply:
        self._send(*wire.probe_out(probe))
        return wire.reply_in(*self._recv("calling the module"))

    def output(self) -> str:
        """What the submission printed (capped by the warden), once it has ended."""
        return self._output

    def close(self, kill: bool = False) -> dict:
        """End the sandbox and everything it started (``kill``: at once, without waiting for it to see
        its request pipe close); the warden's status."""
        if not self._closed:
            self._closed = True
            for fd in (self._req, self._rep):
                try:
                    os.close(fd)
                except OSError:
                    pass
            if kill:
                self._warden.terminate()
            if not self._warden.wait(3):  # the sandbox sees EOF and returns; the warden sweeps
                self._warden.terminate()
                if not self._warden.wait(5):
                    self._warden.kill()
            try:
                self._output = Path(self.log).read_text(errors="replace")
                self._status = json.loads(Path(self.log + ".status").read_text())
            except (OSError, ValueError):
                self._output, self._status = "", {}
            shutil.rmtree(self._log_dir, ignore_errors=True)
        return self._status

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close(kill=True)


# --- starting a warden ---------------------------------------------------------------------------------


def _missing_module_hint(msg: str, path: Path) -> str:
    """What to do about a module the submission imports that its process could not find: its own file beside it
    (the submission's folder is not on the import path, so that a classmate's torch.py cannot shadow a library), or
    a package missing from the grader's environment (einops, timm)."""
    top = msg.split("No module named ", 1)[1].strip("'\"").split(".")[0]
    if (path.parent / f"{top}.py").is_file() or (path.parent / top / "__init__.py").is_file():
        return (f" -- it is the submission's own {top}.py beside it: a submission is graded as one file (its folder "
                f"is not on the import path, so that no file there can stand in for a library): put what it takes "
                f"from {top} into the file graded")
    return (f" -- a package the submission imports is not installed where the grader runs: install the one that "
            f"provides {top!r} into the grader's environment ({sys.executable} -m pip install ...), then grade again")


def _env(home: str | None = None) -> dict:
    """The environment of the sandbox's processes (:func:`multihead.grader.zygote.environment`)."""
    return environment(home)


class _Process:
    """A warden started by this process (the exec path)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    def terminate(self) -> None:
        self.proc.terminate()

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def wait(self, timeout: float) -> bool:
        try:
            self.proc.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False


class _Forked:
    """A warden forked by the fork server (not this process's child): done when it has written its status."""

    def __init__(self, pid: int, log: str):
        self.pid, self.status = pid, log + ".status"

    def _signal(self, sig) -> None:
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def wait(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while not os.path.exists(self.status):
            if time.monotonic() > end:
                return False
            time.sleep(0.005)
        return True


def _exec_warden(request: dict):
    """A fresh ``python -m multihead.grader.warden`` over a fresh ``python -m multihead.grader.sandbox``."""
    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    argv = [sys.executable, "-m", "multihead.grader.sandbox", str(req_r), str(rep_w), request["path"],
            request["name"], json.dumps(request["init"]), request["call"], str(request["seed"]), request["scratch"]]
    warden = [sys.executable, "-m", "multihead.grader.warden", request["log"], str(request["memory"]),
              str(request["cpu"]), str(request["processes"]), "--", *argv]
    env = dict(_env(request["scratch"]), MULTIHEAD_SANDBOX_FDS=f"{req_r},{rep_w}")
    proc = subprocess.Popen(warden, pass_fds=(req_r, rep_w), env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(req_r)
    os.close(rep_w)
    return _Process(proc), req_w, rep_r


class _Zygote:
    """The fork server (:mod:`multihead.grader.zygote`), started once per process (or adopted: :func:`adopt`); it
    ends with this process."""

    def __init__(self, started: tuple | None = None):
        if started is None:
            self.sock, theirs = socket.socketpair()
            self.home = tempfile.mkdtemp(prefix="multihead-zygote-")  # its HOME and TMPDIR; each sandbox its own
            self.proc = subprocess.Popen([sys.executable, "-m", "multihead.grader.zygote", str(theirs.fileno())],
                                         pass_fds=(theirs.fileno(),), env=_env(self.home), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            theirs.close()
        else:
            self.sock, self.proc, self.home = started
        atexit.register(shutil.rmtree, self.home, True)
        self.lock = threading.Lock()
        self.used = False  # whether a sandbox was asked of it

    def spawn(self, request: dict, log: str):
        self.used = True
        with self.lock:
            self.sock.sendall(json.dumps(request).encode() + b"\n")
            msg, fds, _, _ = socket.recv_fds(self.sock, 4096, 2)
        if not msg or len(fds) != 2:
            raise OSError("the fork server did not answer")
        return _Forked(int(json.loads(msg)["pid"]), log), fds[0], fds[1]


_ZYGOTE: list = []
_ZYGOTE_LOCK = threading.Lock()


@atexit.register
def _stop_zygote() -> None:
    """At exit: close the fork server's socket (it then returns) and wait for it; one never used (a command that
    ended before grading) is ended at once, without waiting for its torch to load."""
    for z in _ZYGOTE:
        if z is not None:
            z.sock.close()
            if not z.used:
                z.proc.kill()
            try:
                z.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                z.proc.kill()


def adopt(sock: socket.socket, proc: subprocess.Popen, home: str, script: str) -> bool:
    """Take as this process's fork server one started before this process imported torch (by :mod:`multihead_cli`,
    ``python -I script --clean FD HOME``: its torch loads beside this process's own): its control socket, its
    process and its HOME. Refused (closed; False) where this process has one already, where ``script`` is not this
    multihead's fork server, or where it has ended."""
    with _ZYGOTE_LOCK:
        if not _ZYGOTE and os.path.realpath(script) == os.path.realpath(zygote.__file__) and proc.poll() is None:
            _ZYGOTE.append(_Zygote((sock, proc, home)))
            return True
    sock.close()  # it returns when its socket closes
    shutil.rmtree(home, ignore_errors=True)
    return False



def _zygote() -> _Zygote | None:
    """The process's fork server, started on first use; None where it cannot run (then each sandbox is a
    fresh Python)."""
    with _ZYGOTE_LOCK:
        if not _ZYGOTE:
            ok = sys.platform.startswith("linux") and hasattr(socket, "send_fds") and \
                os.environ.get("MULTIHEAD_GRADER_FORK", "1") != "0"
            _ZYGOTE.append(_Zygote() if ok else None)
        z = _ZYGOTE[0]
        if z is not None and z.proc.poll() is not None:  # it ended: start another
            z = _ZYGOTE[0] = _Zygote()
        return z
