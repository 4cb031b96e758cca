"""A fresh clone passes its tests: nothing reaches for a file beside the checkout except the one
fixture that reads the real Criteo sample (tests/conftest.py's `criteo_sample`, whose path
tests/data_helpers.py's real_sample_path says), no Criteo data is in
the repository, and without the sample the tests that use it skip, each naming $CRITEO_SAMPLE, and
none fails (what a user's clone, with no sample directory beside it, sees)."""
from __future__ import annotations

import os
import re
import subprocess
import sys

from data_helpers import CRITEO_SAMPLE_ENV

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# a path into the directory beside the checkout, or the sample's file name
BESIDE = re.compile("|".join([r"\.\./" + "shared", r"""["']""" + "shared" + r"""["']\s*[,)/]""",
                              "criteo_sample_" + "2k"]))
CODE = ("trainer", "kernels", "conf", "scripts", "benchmarks", "dev", "tests", ".ci")


def _files(tops: tuple[str, ...]) -> list[str]:
    out = []
    for top in tops:
        for d, dirs, files in os.walk(os.path.join(ROOT, top)):
            dirs[:] = [x for x in dirs if x != "__pycache__"]
            out += [os.path.join(d, f) for f in files]
    return out


def test_only_the_fixture_reaches_beside_the_checkout():
    found = []
    for path in _files(CODE) + [os.path.join(ROOT, "Dockerfile"), os.path.join(ROOT, "pyproject.toml")]:
        rel = os.path.relpath(path, ROOT)
        if rel in ("tests/data_helpers.py", "tests/docs/test_fresh_clone.py") or path.endswith(".md") or not os.path.isfile(path):
            continue  # the dated reports (.md) record what was run at the time
        try:
            text = open(path, encoding="utf-8").read()
        except UnicodeDecodeError:
            continue
        found += [f"{rel}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}" for m in BESIDE.finditer(text)]
    assert not found, ("only tests/data_helpers.py's real_sample_path may name the real sample or the "
                       "directory beside the checkout:\n" + "\n".join(found))
    helpers = open(os.path.join(ROOT, "tests", "data_helpers.py")).read()
    conftest = open(os.path.join(ROOT, "tests", "conftest.py")).read()
    assert BESIDE.findall(helpers) and "def criteo_sample(" in conftest and "real_sample_path()" in conftest


def test_no_criteo_data_in_the_repository():
    """Criteo's terms: research use, no redistribution."""
    data = [os.path.relpath(p, ROOT) for p in _files(CODE + ("docs",))
            if re.search(r"\.(tsv|tsv\.gz|txt\.gz)$|criteo_sample", os.path.basename(p))]
    assert not data, data


def test_without_the_sample_its_tests_skip_naming_the_variable(tmp_path):
    """The real-sample tests (marked real_sample by conftest) with $CRITEO_SAMPLE pointing nowhere:
    every one skipped with the variable's name, none failed, exit status 0."""
    env = {**os.environ, CRITEO_SAMPLE_ENV: str(tmp_path / "nowhere" / "criteo_sample.tsv")}
    env.pop("PYTEST_XDIST_WORKER", None)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-n", "0", "-m", "real_sample",
                           "-p", "no:cacheprovider", "tests"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-2000:]
    m = re.search(r"(?m)^(\d+) skipped, (\d+) deselected in ", out)
    assert m and int(m.group(1)) >= 2, out[-2000:]  # nothing passed, failed or errored: only skips
    skipped = [x for x in out.splitlines() if x.startswith("SKIPPED")]
    assert len(skipped) == int(m.group(1)) and all(CRITEO_SAMPLE_ENV in x for x in skipped), skipped
