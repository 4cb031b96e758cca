"""Run many Python command lines as the interpreter would run each, paying for the heavy imports once.

    python tests/script_runner.py [--jobs N] < cases.json > results.json

Why: `python scripts/plan.py --help` costs a second or more, almost all of it importing torch,
Hydra and numpy; a table of twenty scripts' --help and bad-input runs would spend most of a minute
on the same imports. This process imports those third-party packages (never the repository's own
modules) and then forks one child per case, so each child starts with them in memory and nothing
else: `import trainer` and the script itself run afresh in every child, from the child's sys.path.

A case is {"argv": [SCRIPT, args...] or ["-m", MODULE, args...], "cwd": DIR, "env": {...},
"timeout": seconds}. The child sets what `python SCRIPT ...` / `python -m MODULE ...` sets
(sys.argv, sys.path[0]: the script's directory, or the working directory for -m), runs the code as
__main__ with runpy, runs the atexit handlers and exits with the interpreter's status: SystemExit's
code (a message is printed to stderr with status 1), 0 when the code returns, 1 with the traceback
on stderr when an exception escapes. Its stdout and stderr go to files the parent reads back.

The results (stdout, a JSON list in case order): {"rc", "stdout", "stderr", "timed_out", "seconds"}.
A child past its timeout is killed with its process group (rc -9, timed_out true). Up to --jobs
children run at once (default: the cores), so cases must not share files.
"""
from __future__ import annotations

import atexit
import json
import os
import runpy
import shutil
import signal
import sys
import tempfile
import time
import traceback

PRELOAD = ("numpy", "torch", "omegaconf", "hydra", "hydra.errors")  # third-party only: never the repo's


def _exit_code(exc: SystemExit) -> int:
    """The status the interpreter gives `raise SystemExit(code)` (a message is printed, status 1)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _child(case: dict, out: str, err: str) -> None:
    """In the forked child: become `python ARGV` and exit with its status (never returns)."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own process group: a timeout kills whatever it started too
        for fd, path in ((1, out), (2, err)):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(f, fd)
            os.close(f)
        os.environ.update(case.get("env") or {})
        os.chdir(case.get("cwd") or os.getcwd())
        argv = list(case["argv"])
        if argv[0] == "-m":
            sys.argv, sys.path[0] = [argv[1], *argv[2:]], os.getcwd()
            run = lambda: runpy.run_module(argv[1], run_name="__main__", alter_sys=True)  # noqa: E731
        else:
            script = os.path.abspath(argv[0])
            sys.argv, sys.path[0] = [argv[0], *argv[1:]], os.path.dirname(script)
            run = lambda: runpy.run_path(script, run_name="__main__")  # noqa: E731
        try:
            run()
            code = 0
        except SystemExit as exc:
            code = _exit_code(exc)
        except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - the child itself failed: say so where the parent reads
        traceback.print_exc()
        code = 125
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream: nothing left to flush
                pass
        os._exit(code)


def _start(case: dict, out: str, err: str) -> int:
    """Fork the child of `case` writing to out / err; its pid."""
    for path in (out, err):
        open(path, "w").close()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _child(case, out, err)
    return pid


def _read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def run_cases(cases: list[dict], tmp: str, jobs: int) -> list[dict]:
    """Every case, up to `jobs` children at once; the results in case order."""
    results: list[dict] = [{} for _ in cases]
    running: dict[int, tuple[int, float, str, str]] = {}  # pid -> (case index, start, out, err)
    todo = list(range(len(cases)))
    while todo or running:
        while todo and len(running) < jobs:
            i = todo.pop(0)
            out, err = os.path.join(tmp, f"{i}.out"), os.path.join(tmp, f"{i}.err")
            running[_start(cases[i], out, err)] = (i, time.monotonic(), out, err)
        for pid, (i, t0, out, err) in list(running.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            timed_out = not done and time.monotonic() - t0 > float(cases[i].get("timeout", 120))
            if timed_out:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                _, status = os.waitpid(pid, 0)
            if done or timed_out:
                del running[pid]
                results[i] = {"rc": os.waitstatus_to_exitcode(status), "stdout": _read(out), "stderr": _read(err),
                              "timed_out": timed_out, "seconds": round(time.monotonic() - t0, 3)}
        time.sleep(0.01)
    return results


def main() -> int:
    cases = json.load(sys.stdin)
    for name in PRELOAD:
        __import__(name)
    jobs = int(sys.argv[sys.argv.index("--jobs") + 1]) if "--jobs" in sys.argv else (os.cpu_count() or 1)
    tmp = tempfile.mkdtemp(prefix="script_runner-")  # no finalizer: a child's atexit must not remove it
    try:
        results = run_cases(cases, tmp, max(1, jobs))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    json.dump(results, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
