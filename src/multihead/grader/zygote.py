"""The grader's fork server: ``python -m multihead.grader.zygote FD``, a trusted process that imports
torch and the sandbox's code once, then, per request on its control socket (FD), forks a warden
(:func:`multihead.grader.warden.forked`) whose sandbox is a fork too -- so a submission's process
starts in milliseconds with torch already imported, instead of the ~2.5 s a fresh Python needs. It never
imports a submission (only its forked children do, after the limits are set) and holds nothing of the
grader's but what it was started with.

A request is a JSON line (path, name, init, call, seed, log, memory, cpu, processes); the reply is
the warden's pid with two descriptors passed over the socket (SCM_RIGHTS): the sandbox's request
pipe's write end and its reply pipe's read end.

Its environment is built, not inherited (:func:`environment`). ``python -I .../zygote.py --clean FD HOME`` starts
one from a process that has not imported multihead yet (the ``multihead`` command grading, :mod:`multihead_cli`:
its torch then loads beside the grader's own): this file, run by path, imports only the standard library, and
replaces itself at once with ``python -m multihead.grader.zygote FD`` in that environment, so nothing of the
grader's environment stays in its memory.
"""

from __future__ import annotations

import json
import os
import socket
import sys

#: the grader's environment variables a submission's process is given (all others, a teacher's tokens among them,
#: never reach it): where programs and libraries are, the locale, the time zone, how Python and Keras start
ENV_KEPT = ("PATH", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "LC_NUMERIC", "LC_MESSAGES", "TZ", "LD_LIBRARY_PATH",
            "PYTHONPATH", "PYTHONHASHSEED", "PYTHONDONTWRITEBYTECODE", "KERAS_BACKEND", "CUDA_VISIBLE_DEVICES")


def environment(home: str | None = None, grader: dict | None = None) -> dict:
    """The environment of the sandbox's processes, built, not inherited: the variables of :data:`ENV_KEPT` that
    the grader has (in ``grader``, default ``os.environ``), one thread for torch, unbuffered output, Keras on torch,
    the grader's own code on the import path, and HOME and TMPDIR ``home`` (the sandbox's scratch folder; the fork
    server's own empty folder)."""
    grader = os.environ if grader is None else grader
    env = {k: grader[k] for k in ENV_KEPT if k in grader}
    env |= {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.setdefault("KERAS_BACKEND", "torch")  # a learner's Keras 3 layer is graded as the torch module it then is
    env.setdefault("PATH", os.defpath)
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if home is not None:
        env["HOME"] = env["TMPDIR"] = home
    return env


def _serve_one(conn: socket.socket, req: dict) -> None:
    from multihead.grader import sandbox, warden

    req_r, req_w = os.pipe()
    rep_r, rep_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the warden (its sandbox is forked from it, below)
        try:
            conn.close()
            os.close(req_w)
            os.close(rep_r)
            warden.forked(req["log"], int(req["memory"]), int(req["cpu"]), int(req["processes"]), (req_r, rep_w),
                          lambda: sandbox.serve(req_r, rep_w, req["path"], req["name"], init=req["init"],
                                                call=req["call"], seed=int(req["seed"]), scratch=req["scratch"]))
        finally:
            os._exit(0)
    os.close(req_r)
    os.close(rep_w)
    socket.send_fds(conn, [json.dumps({"pid": pid}).encode()], [req_w, rep_r])
    os.close(req_w)
    os.close(rep_r)


def main(argv: list[str]) -> int:
    import torch  # noqa: F401 - imported once here, inherited by every sandbox

    from multihead.grader import sandbox, warden  # noqa: F401 - likewise (warden also reaps below)

    torch.set_num_threads(1)
    conn = socket.socket(fileno=int(argv[0]))
    buf = b""
    while True:
        try:
            while b"\n" not in buf:
                chunk = conn.recv(65536)
                if not chunk:
                    return 0
                buf += chunk
        except OSError:
            return 0
        line, buf = buf.split(b"\n", 1)
        _serve_one(conn, json.loads(line))
        warden.reap()  # the wardens that have finished


if __name__ == "__main__":
    if sys.argv[1:2] == ["--clean"]:  # run by path, with the grader's environment: leave it behind, then serve
        os.execve(sys.executable, [sys.executable, "-m", "multihead.grader.zygote", sys.argv[2]],
                  environment(sys.argv[3]))
    sys.exit(main(sys.argv[1:]))
