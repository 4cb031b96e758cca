"""Every command shown in the docs runs as printed and does what the text beside it says.

Which commands (the rule, also in docs/development.md, "The commands in the docs are tested"):
README.md, docs/*.md and benchmarks/README.md (not the dated reports under benchmarks/reports/,
which record what was run at the time). A command is a line of a fenced block whose info string is
`bash`; a line ending in a backslash continues on the next one; `#` outside quotes (at the start
or after a blank) begins a comment; blank and comment-only lines are skipped. Indented blocks and
fences of another kind (```text) are never run. Inline code that reads as a command
(docs_registry.reads_as_command) must be a block command (or its start), an abbreviation, an
INLINE entry (run here as a block of its own, or by the test it names), or in INLINE_NOT_RUN with why.

How (tests/docs_registry.py): REGISTRY and INLINE map each command (its exact text, joined, comment
stripped) to an Entry: the overrides that only shrink it (`shrink`: old -> new text, each a key whose
value goes down; `add`: arguments appended, from SHRINK_KEYS or OFF_SWITCHES) and the checks of
what the text beside it promises (`files` it writes, the keys and values of the JSON line it
prints, a pattern of its stdout, `check` for the rest). Placeholders are made, never substituted:
`DIR` is the suite's Criteo-format sample (tests/data_helpers.py: 1,999 made-up rows in Criteo's raw
format) prepared once per session (linked into the scratch dir) unless the entry says the command
writes it; `FILE.tsv`, `TRAIN.tsv`, `TEST.tsv`, `train.txt`, `day_*.gz` are cut from the sample into
the scratch dir under their own names; `OUT` is a new directory; `host1`, `host2` are emulated hosts.

Every block runs in one scratch directory that links the checkout's scripts/, benchmarks/, dev/,
conf/, trainer/, kernels/, tests/ and the virtual environment as .venv, so its relative paths work
as written and nothing is written into the checkout; a block's commands run in order (a later one
may read what an earlier one wrote), except lines for different hosts (Entry.host), which run at
once, each inside its emulated host (dev/netcluster.py). Markers: `gpu` (a CUDA device), `docker`
(a container engine), `netns` (root and `ip netns`: runs in this project's CI) on the blocks whose
commands need them, each skipped with its reason where that is missing. A command without an entry
fails, naming file:line; an entry whose command is no longer in the docs fails too. The README's
test command is checked to be .ci/run's, exactly, rather than run again; the first command's
training part is run.
"""
from __future__ import annotations

import glob
import gzip
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from dev.memcg import parse_size
from docs_registry import (DOCS, FILE_ROWS, INLINE, INLINE_NOT_RUN, LINKS, OFF_SWITCHES, REGISTRY,
                           ROOT, SETUP, SHRINK_KEYS, SUMMARY_RE, Command, Entry, _normal, abbreviated, all_blocks,
                           all_commands, command_line, inline_commands, parse_blocks)

def _inline_spans() -> list[tuple[str, int, str]]:
    return [(rel, n, text) for rel in DOCS for n, text in inline_commands(rel)]


def test_every_inline_command_is_run():
    """Inline code that reads as a command runs: as (the start of) a block command, as an INLINE
    entry of its own, or by the test its entry names; the rest are abbreviations or INLINE_NOT_RUN."""
    blocks = [_normal(c.text) for c in all_commands()]
    loose = []
    for rel, n, text in _inline_spans():
        if text in INLINE or text in INLINE_NOT_RUN or abbreviated(text):
            continue
        if not any(b == _normal(text) or b.startswith(_normal(text) + " ") for b in blocks):
            loose.append(f"{rel}:{n}: `{text}`")
    assert not loose, ("commands shown inline that nothing runs (put them in a bash block with a REGISTRY "
                       "entry, give them an INLINE entry, or abbreviate them with `...`):\n" + "\n".join(loose))


def test_benchmarks_and_dev_run_as_modules():
    """benchmarks/ and dev/ are never installed: the docs run them as modules from the repository
    root (`python -m benchmarks.bench_train`), never by a file of theirs (`benchmarks/bench_train.py`)."""
    files = {os.path.basename(p) for top in ("benchmarks", "dev")
             for p in glob.glob(str(ROOT / top / "**" / "*.py"), recursive=True)} - {"__init__.py"}
    shown = [(c.where, c.text) for c in all_commands()] + [(f"{rel}:{n}", t) for rel, n, t in _inline_spans()]
    by_file = [f"{where}: `{text}`" for where, text in shown
               if any(os.path.basename(w) in files for w in text.split() if w.endswith(".py"))]
    assert not by_file, "run these as `python -m benchmarks.NAME` / `python -m dev.NAME`:\n" + "\n".join(by_file)


def test_every_inline_entry_is_still_in_the_docs():
    shown = {text for _, _, text in _inline_spans()}
    stale = [t for t in [*INLINE, *INLINE_NOT_RUN] if t not in shown]
    assert not stale, "INLINE / INLINE_NOT_RUN entries no longer shown inline in the docs:\n" + "\n".join(stale)


# ---------------------------------------------------------------------------------------------
# Checks on the registry itself


def _key_value(arg: str) -> tuple[str, str]:
    if arg.startswith("--"):
        key, _, value = arg.partition(" ")
        return key, value
    key, _, value = arg.partition("=")
    return key, value


def _lower(old: str, new: str) -> bool:
    """new is the same kind of value as old, and no larger (lists: a subset; a flag's values
    separated by spaces are a list too)."""
    if "," in old or "," in new:
        return set(new.split(",")) <= set(old.split(","))
    if " " in old.strip() or " " in new.strip():
        return set(new.split()) <= set(old.split())
    try:
        return float(new) <= float(old)
    except ValueError:
        pass
    try:  # sizes: 20G, 600M
        return parse_size(new) <= parse_size(old)
    except ValueError:
        return False


def test_every_documented_command_has_an_entry():
    missing = [f"{c.where}: {c.text}" for c in all_commands() if c.text not in REGISTRY]
    assert not missing, ("commands in the docs without an entry in tests/docs/test_docs_commands.py REGISTRY "
                         "(add one: how to run and check it):\n" + "\n".join(missing))


def test_every_entry_is_still_in_the_docs():
    shown = {c.text for c in all_commands()}
    stale = [t for t in REGISTRY if t not in shown]
    assert not stale, "REGISTRY entries whose command is no longer in the docs:\n" + "\n".join(stale)


def test_entries_only_shrink_their_commands():
    problems = []
    for text, e in [*REGISTRY.items(), *INLINE.items()]:
        for old, new in e.shrink:
            (ko, vo), (kn, vn) = _key_value(old), _key_value(new)
            if old not in text:
                problems.append(f"{text}: shrinks {old!r}, which it does not contain")
            elif ko != kn or ko not in SHRINK_KEYS or not _lower(vo, vn):
                problems.append(f"{text}: {old!r} -> {new!r} is not a shrink of a SHRINK_KEYS value")
        args = list(e.add)
        i = 0
        while i < len(args):
            a = args[i]
            if a in OFF_SWITCHES:
                i += 1
                continue
            if a.startswith("--"):
                key, value, i = a, args[i + 1] if i + 1 < len(args) else "", i + 2
            else:
                (key, value), i = _key_value(a), i + 1
            if key not in SHRINK_KEYS:
                problems.append(f"{text}: adds {a!r}, not one of SHRINK_KEYS / OFF_SWITCHES")
            for m in re.finditer(rf"(?:^|\s){re.escape(key)}[= ](\S+)", text):
                if not _lower(m.group(1), value):
                    problems.append(f"{text}: adds {key} {value}, above the command's own {m.group(1)}")
        for mark in e.marks:
            if mark not in ("gpu", "docker", "netns"):
                problems.append(f"{text}: unknown marker {mark}")
        if e.host is not None and "netns" not in e.marks:
            problems.append(f"{text}: runs in an emulated host, so it needs the netns marker")
    assert not problems, "\n".join(problems)


def _ci_command() -> list[str]:
    lines = [x.strip() for x in (ROOT / ".ci" / "run").read_text().splitlines()]
    runs = [x for x in lines if x.startswith("bash scripts/setup.sh")]
    assert len(runs) == 1, f".ci/run should run one `bash scripts/setup.sh && ...` line, has {runs}"
    return shlex.split(runs[0])


def test_ci_runs_the_readme_setup_and_test_commands():
    """The README's first two commands: .ci/run runs the test command exactly as the README prints
    it (pytest's options live in pyproject.toml, for both); the first command's own part after the
    set-up runs in its block."""
    ci = _ci_command()
    top = [c for c in parse_blocks("README.md")[0]]
    assert [REGISTRY[c.text].ci for c in top] == ["setup+run", "setup+ci"], \
        f"README.md:{top[0].line}: the first block must be the set-up + train and set-up + test commands"
    for c in top:
        assert c.text.startswith(SETUP), f"{c.where}: does not start with `{SETUP}`"
    assert ci == shlex.split(top[1].text), f"{top[1].where}: `{top[1].text}` is not what .ci/run runs (`{' '.join(ci)}`)"


# ---------------------------------------------------------------------------------------------
# Running the blocks


def _lines(a: int, b: int) -> list[str]:
    from data_helpers import sample_lines

    return sample_lines()[a:b]


@pytest.fixture(scope="session")
def prepared_sample(tmp_path_factory) -> Path:
    """DIR: the suite's sample prepared once (train = first 1,600 rows, test = the rest; 1,000 rows
    per table, so a run sets up in a second)."""
    from data_helpers import prepare_sample

    out = tmp_path_factory.mktemp("docs_sample")
    prepare_sample(str(out))
    return out / "prepared"


def _materialize(word: str, cwd: Path, rows: dict[str, tuple[int, int]]) -> None:
    a, b = rows.get(word, FILE_ROWS[word])
    data = "".join(_lines(a, b))
    if word.endswith(".gz"):
        with gzip.open(cwd / word, "wt") as f:
            f.write(data)
    else:
        (cwd / word).write_text(data)


def _scratch(tmp_path: Path) -> Path:
    cwd = tmp_path / "work"
    cwd.mkdir()
    for name in LINKS:
        os.symlink(ROOT / name, cwd / name)
    os.symlink(sys.prefix, cwd / ".venv")
    return cwd


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PATH"] = os.path.join(sys.prefix, "bin") + os.pathsep + env.get("PATH", "")
    env.pop("PYTEST_CURRENT_TEST", None)
    return env


def _has_netns() -> Optional[str]:
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None or subprocess.run(["ip", "netns", "list"], capture_output=True).returncode:
        return "needs `ip netns`"
    return None


def _engine_fails(name: str) -> Optional[str]:
    """Why the container engine `name` (podman or docker) does not run here, or None."""
    if shutil.which(name) is None:
        return f"no `{name}`"
    if subprocess.run([name, "info"], capture_output=True, timeout=120).returncode:
        return f"`{name} info` fails"
    return None


def _has_docker() -> Optional[str]:
    """A container engine runs: podman or docker (scripts/build_image.sh uses either); a command
    that names one needs that one (checked per command)."""
    whys = [_engine_fails(e) for e in ("podman", "docker")]
    return None if None in whys else f"needs a running container engine ({'; '.join(whys)})"


def _has_gpu() -> Optional[str]:
    import torch

    return None if torch.cuda.is_available() else "needs a CUDA device"


NEEDS = {"gpu": _has_gpu, "docker": _has_docker, "netns": _has_netns}


def _last_json(stdout: str) -> Optional[dict[str, Any]]:
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def _prepare(c: Command, e: Entry, cwd: Path, sample: Callable[[], Path]) -> str:
    """The command line to run, with the placeholders it names made in the scratch dir."""
    line = command_line(c.text, e)
    rows = {w: (a, b) for w, a, b in e.rows}
    for word in FILE_ROWS:
        if re.search(rf"(?<![\w/.]){re.escape(word)}\b", line) and not (cwd / word).exists():
            _materialize(word, cwd, rows)
    if re.search(r"\bDIR\b", line) and not e.writes_dir and not (cwd / "DIR").exists():
        os.symlink(sample(), cwd / "DIR")
    if re.search(r"\bOUT\b", line):
        (cwd / "OUT").mkdir(exist_ok=True)
    return line


def _popen(line: str, e: Entry, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(["bash", "-c", line], cwd=ROOT if e.in_checkout else cwd, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _serve(c: Command, e: Entry, line: str, cwd: Path) -> Optional[str]:
    """A server: it must say it serves (e.serves in its output) and answer there, then it is stopped."""
    import threading
    import urllib.request

    proc = subprocess.Popen(["bash", "-c", line], cwd=cwd, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    seen: list[str] = []
    threading.Thread(target=lambda: seen.extend(proc.stdout), daemon=True).start()
    deadline = time.monotonic() + e.timeout
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            m = re.search(e.serves, "".join(seen))
            if m:
                url = re.search(r"http://\S+?:\d+/", m.group(0)).group(0)
                with urllib.request.urlopen(url, timeout=30) as r:
                    return None if r.status == 200 else f"{c.where}: {url} answered {r.status}"
            time.sleep(0.2)
        return (f"{c.where}: `{c.text}` did not say it serves ({e.serves!r}) within {e.timeout} s "
                f"(rc {proc.poll()}; ran: {line})\n--- output ---\n{''.join(seen)[-3000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _outcome(c: Command, e: Entry, cwd: Path, line: str, rc: int, out: str, err: str) -> Optional[str]:
    """None when the finished command did what its text says, else what went wrong."""
    out = re.sub(r"(?m)^\[\d+(?:,\d+)?\]<stdout>:", "", out)  # horovodrun prefixes each rank's lines ([1,0]: under MPI)
    tail = f"\n--- stdout (end) ---\n{out[-2000:]}\n--- stderr (end) ---\n{err[-4000:]}"
    if rc != 0:
        return f"{c.where}: `{c.text}` exited {rc} (ran: {line}){tail}"
    problems = []
    for f in e.files:
        if not (cwd / f).exists():
            problems.append(f"{f} was not written")
    if e.json_keys or e.json_values:
        rec = _last_json(out)
        if rec is None:
            problems.append("no JSON line on stdout")
        else:
            lost = [k for k in e.json_keys if k not in rec]
            if lost:
                problems.append(f"its JSON line has no {lost} (keys: {sorted(rec)})")
            wrong = [(k, rec.get(k), v) for k, v in e.json_values if rec.get(k) != v]
            if wrong:
                problems.append(f"its JSON line has (key, got, documented) {wrong}")
    if e.stdout and not re.search(e.stdout, out):
        problems.append(f"stdout does not match {e.stdout!r}")
    if e.summary:
        m = re.search(SUMMARY_RE, out)
        path = None if m is None else Path(m.group("path"))
        if path is None or not (path if path.is_absolute() else cwd / path).is_file():
            problems.append("no `summary: PATH` line naming a summary.json that exists")
    if e.check is not None and not problems:
        try:
            e.check(cwd, out)
        except AssertionError as exc:
            problems.append(str(exc))
    if problems:
        return (f"{c.where}: `{c.text}` does not do what the text says: {'; '.join(problems)} "
                f"(ran: {line}){tail}")
    return None


def _run_one(c: Command, e: Entry, cwd: Path, sample: Callable[[], Path]) -> Optional[str]:
    """Run one command; None when it did what its text says, else what went wrong."""
    line = _prepare(c, e, cwd, sample)
    if e.serves:
        return _serve(c, e, line, cwd)
    proc = _popen(line, e, cwd)
    try:
        out, err = proc.communicate(timeout=e.timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher's workers too
        out, err = proc.communicate()
        return (f"{c.where}: `{c.text}` did not finish within {e.timeout} s (ran: {line})\n"
                f"--- stderr (end) ---\n{err[-3000:]}")
    return _outcome(c, e, cwd, line, proc.returncode, out, err)


def _run_on_hosts(runnable: list[tuple[Command, Entry]], cwd: Path, sample: Callable[[], Path]) -> list[Optional[str]]:
    """Commands that each run on their own host (`host1`, `host2`, ... as the docs name them), all at
    once, each inside its emulated host (dev/netcluster.py), the scratch dir shared as a cluster's
    filesystem would be."""
    from dev.netcluster import NetCluster

    lines = [_prepare(c, e, cwd, sample) for c, e in runnable]
    n = 1 + max(e.host for _, e in runnable)
    with NetCluster(hosts=n, names=[f"host{k + 1}" for k in range(n)]) as cluster:
        results = cluster.launch([(e.host, ["bash", "-c", line]) for (_, e), line in zip(runnable, lines)],
                                 timeout=max(e.timeout for _, e in runnable), env=cluster.env(base=_env()),
                                 cwd=str(cwd))
    return [(f"{c.where}: `{c.text}` did not finish within {e.timeout} s (ran: {line}; inside host{e.host + 1})"
             f"\n--- stderr (end) ---\n{r.stderr[-3000:]}") if r.timed_out
            else _outcome(c, e, cwd, line, r.returncode, r.stdout, r.stderr)
            for (c, e), line, r in zip(runnable, lines, results)]


def _inline_blocks() -> list[list[Command]]:
    """Each INLINE command that runs here (not elsewhere), as a block of its own, where it is first shown."""
    first: dict[str, Command] = {}
    for rel in DOCS:
        for n, text in inline_commands(rel):
            first.setdefault(text, Command(rel, n, text, ""))
    return [[first[t]] for t, e in INLINE.items() if t in first]


def _block_params() -> list[Any]:
    params = []
    for block in all_blocks() + _inline_blocks():
        entries = [REGISTRY.get(c.text) or INLINE.get(c.text) for c in block]
        marks = sorted({m for e in entries if e is not None for m in e.marks})
        params.append(pytest.param(block, id=block[0].where, marks=[getattr(pytest.mark, m) for m in marks]))
    return params


def _check_elsewhere(c: Command, elsewhere: str) -> None:
    """An entry run by another test: that test function (or fixture) calls `documented(<the
    command's exact text>)`, so it runs the command as printed, shrunk only as its entry says."""
    import ast

    path, _, name = elsewhere.partition("::")
    tree = ast.parse((ROOT / path).read_text())
    fns = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    assert fns, f"{c.where}: {elsewhere} does not exist"
    calls = [n for n in ast.walk(fns[0]) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "documented"]
    texts = [n.args[0].value for n in calls if n.args and isinstance(n.args[0], ast.Constant)]
    assert c.text in texts, f"{c.where}: {elsewhere} does not run documented({c.text!r}) (it runs {texts})"


@pytest.mark.parametrize("block", _block_params())
def test_documented_commands_run(block: list[Command], tmp_path: Path, request) -> None:
    """One fenced bash block (or an inline command with an INLINE entry): its commands in order, in
    one scratch directory; those that run on a host of their own (host1, host2) at once, each in
    its emulated host."""
    entries = [REGISTRY.get(c.text) or INLINE.get(c.text) for c in block]
    missing = [c.where for c, e in zip(block, entries) if e is None]
    assert not missing, f"no REGISTRY entry for the command(s) at {missing}"
    for c, e in zip(block, entries):  # run by the named test instead: it must call documented(text)
        if e.elsewhere:
            _check_elsewhere(c, e.elsewhere)
    runnable = [(c, e) for c, e in zip(block, entries) if not e.elsewhere and e.ci != "setup+ci"]
    if not runnable:
        return  # run by the tests named (elsewhere), or by .ci/run (checked against the README above)
    for mark in sorted({m for _, e in runnable for m in e.marks}):
        why = NEEDS[mark]()
        if why:
            pytest.skip(f"{block[0].where}: {why}")
    for c, e in runnable:  # `docker ...` needs docker itself, `podman ...` podman
        engine = c.text.split()[0]
        why = _engine_fails(engine) if "docker" in e.marks and engine in ("docker", "podman") else None
        if why:
            pytest.skip(f"{c.where}: needs a running `{engine}` ({why})")
    cwd = _scratch(tmp_path)
    sample = lambda: request.getfixturevalue("prepared_sample")  # noqa: E731 - only when DIR is used
    cleanups = [e.cleanup for _, e in runnable if e.cleanup]
    failures = []
    try:
        if any(e.host is not None for _, e in runnable):
            assert all(e.host is not None for _, e in runnable), f"{block[0].where}: every command or none on a host"
            failures = _run_on_hosts(runnable, cwd, sample)
        else:
            for c, e in runnable:  # all of them: a later command may fail for its own reason too
                t0 = time.perf_counter()
                failures.append(_run_one(c, e, cwd, sample))
                print(f"{c.where}: {time.perf_counter() - t0:.1f} s{' (failed)' if failures[-1] else ''}")
    finally:
        for cmd in cleanups:
            subprocess.run(["bash", "-c", cmd], cwd=cwd, env=_env(), capture_output=True, timeout=300)
    failures = [f for f in failures if f]
    if failures:
        pytest.fail(f"{len(failures)} of {len(runnable)} commands failed:\n\n" + "\n\n".join(failures))
