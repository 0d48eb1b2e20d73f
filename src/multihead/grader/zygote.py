"""The grader's fork server: ``python -m multihead.grader.zygote FD``, a trusted process that imports
torch and the sandbox's code once, then, per request on its control socket (FD), forks a warden
(:func:`multihead.grader.warden.forked`) whose sandbox is a fork too -- so a submission's process
starts in milliseconds with torch already imported, instead of the ~2.5 s a fresh Python needs. It never
imports a submission (only its forked children do, after the limits are set) and holds nothing of the
grader's but what it was started with.

A request is a JSON line (path, name, init, call, seed, log, memory, cpu, processes); the reply is
the warden's pid with two descriptors passed over the socket (SCM_RIGHTS): the sandbox's request
pipe's write end and its reply pipe's read end.
"""

from __future__ import annotations

import json
import os
import socket
import sys


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
    sys.exit(main(sys.argv[1:]))
