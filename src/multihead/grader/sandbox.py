"""The submission's own process: ``python -m multihead.grader.sandbox REQ REP FILE NAME INIT CALL SEED SCRATCH``.

It imports the learner's file, builds ``NAME(**INIT)`` and then only answers the grader's requests
on two pipes (file descriptors REQ and REP): ``describe`` (the module as data) and ``call`` (one
:class:`~multihead.grader.subject.Probe`), each reply a frame of JSON and safetensors
(:mod:`multihead.grader.wire`). Whatever the submission prints goes to this process's stdout and
stderr, which the warden caps and which never becomes a verdict; the verdict is computed by the
grader from the tensors that cross. It runs under the warden's limits (memory, CPU time, processes), and
before the learner's file is imported it confines itself (:mod:`multihead.grader.confine`, an allow-list): it
reads the Python installation and the copy of the file the grader put in its scratch folder (FILE is the
original's path, a label for messages; the file is handed over, never found by path), writes only there, and has
no network, no socket and no view of another process.
"""

from __future__ import annotations

import json
import os
import sys
import traceback


def _error(rep: int, stage: str, e: BaseException) -> None:
    from multihead.grader import wire

    tb = traceback.extract_tb(e.__traceback__)
    where = next((f"{os.path.basename(f.filename)}:{f.lineno}" for f in reversed(tb)
                  if "multihead" not in f.filename), "")
    wire.send(rep, {"ready": False, "stage": stage, "error": f"{type(e).__name__}: {e}", "where": where})


def handed(scratch: str, path: str) -> str:
    """Where the grader puts the copy of the learner's file ``path`` in the sandbox's ``scratch`` folder (same name:
    messages and a notebook's cell labels read as the learner's)."""
    return os.path.join(scratch, os.path.basename(path))


def _build(path: str, name: str, init: dict, seed: int):
    """The learner's module, built as their notebook would: the file (the copy handed over) imported (a notebook's
    definitions run), then NAME(**init) with torch's seed set. Its folder is not on the import path: a classmate's
    file named torch.py cannot shadow a library."""
    import importlib.util

    import torch

    try:
        if path.endswith(".ipynb"):  # a notebook: its definitions only (multihead.grader.notebook)
            import types

            from multihead.grader import notebook

            mod = types.ModuleType(f"submission_{os.getpid()}")
            mod.__file__ = path
            notebook.run(path, vars(mod))
        else:
            spec = importlib.util.spec_from_file_location(f"submission_{os.getpid()}", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
    except BaseException as e:  # noqa: BLE001 - the learner's file (SystemExit included)
        return None, ("import", e)
    if not hasattr(mod, name):
        names = [n for n in vars(mod) if not n.startswith("_") and isinstance(vars(mod)[n], type)]
        return None, ("lookup", LookupError(f"{os.path.basename(path)} has no {name!r}; it defines "
                                            f"{', '.join(names) or 'no class'}"))
    torch.manual_seed(seed)
    try:
        module = getattr(mod, name)(**init)
    except BaseException as e:  # noqa: BLE001
        return None, ("build", e)
    if not isinstance(module, torch.nn.Module):
        return None, ("build", TypeError(f"{name}({', '.join(f'{k}={v!r}' for k, v in init.items())}) is a "
                                         f"{type(module).__name__}, not a torch.nn.Module"))
    return module, None


def _confine(scratch: str, path: str, active: list[str]) -> list[str]:
    """``scratch`` (the grader's folder for this sandbox, removed by the grader when it ends) becomes the working
    directory, home and temporary folder of everything this process runs (torch's compile cache, Keras' config
    included) and the only place it may write; then the allow-list of :mod:`multihead.grader.confine` applies
    (what this machine cannot confine, the grader has said once: :func:`~multihead.grader.confine.unconfined`).
    What the learner's file will need of the grader's code is imported first; ``active`` gets the layers applied
    (the warden's resource limits first)."""
    import tempfile

    import torch  # noqa: F401 - read from the installation before the doors close (the fork server has it)

    from multihead.grader import confine, notebook, subject, wire  # noqa: F401

    read = confine.readable(exclude=(path,))  # here, in the grader's working directory: never that folder
    os.environ["TMPDIR"] = os.environ["HOME"] = tempfile.tempdir = scratch
    os.chdir(scratch)
    active.append("resource limits")  # the warden set them before this process ran anything
    return confine.confine(scratch, read, active=active)  # what it could not confine: the grader compares it with what it said


def serve(req: int, rep: int, path: str, name: str, *, init: dict, call: str, seed: int, scratch: str) -> None:
    layers: list[str] = []
    gaps = _confine(scratch, path, layers)
    _serve(req, rep, path, name, init=init, call=call, seed=seed, scratch=scratch, gaps=(gaps, layers))


def _serve(req: int, rep: int, path: str, name: str, *, init: dict, call: str, seed: int, scratch: str,
           gaps: tuple[list[str], list[str]]) -> None:
    import torch

    from multihead.grader import wire
    from multihead.grader.subject import Pristine, caller, describe, run

    torch.set_num_threads(1)
    module, failed = _build(handed(scratch, path), name, init, seed)
    if failed is not None:
        _error(rep, *failed)
        return
    module.eval()
    pristine = Pristine()  # the module as built: a fresh copy of it answers a call that asks for one
    fn = caller(call)
    n_params = sum(1 for _ in module.parameters())
    wire.send(rep, {"ready": True, "params": n_params, "unconfined": gaps[0], "layers": gaps[1]})
    while True:
        try:
            header, tensors = wire.recv(req)
        except wire.Closed:
            return
        if header.get("op") == "describe":
            wire.send(rep, *wire.description_out(describe(module)))
        elif header.get("op") == "call":
            wire.send(rep, *wire.reply_out(run(module, fn, wire.probe_in(header, tensors), pristine)))
        else:
            return


def main(argv: list[str]) -> int:
    req, rep = int(argv[0]), int(argv[1])
    path, name, init, call, seed, scratch = argv[2], argv[3], json.loads(argv[4]), argv[5], int(argv[6]), argv[7]
    # the reply pipe moves to a private descriptor: a submission writing to 1 or 2 reaches the log only
    rep2 = os.dup(rep)
    os.close(rep)
    os.set_inheritable(rep2, False)
    os.set_inheritable(req, False)
    serve(req, rep2, path, name, init=init, call=call, seed=seed, scratch=scratch)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
