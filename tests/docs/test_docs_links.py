"""Every relative link of the docs leads somewhere: the file exists, and its #anchor is a heading there.

Why: the README is a guide that sends the reader to docs/ pages and dated reports by link ("how do
I resume", "what does summary.json hold", "how fast is it"); a page renamed or a heading reworded
must not leave the link dead. Anchors follow GitHub's rule: the heading in lower case, characters
other than letters, digits, `_`, `-` and spaces dropped, spaces turned into `-`.
"""
from __future__ import annotations

import glob
import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = ["README.md", *glob.glob(str(ROOT / "docs" / "*.md")), "benchmarks/README.md",
         *glob.glob(str(ROOT / "benchmarks" / "reports" / "*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    out, fenced = set(), False
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            out.add(slug(line.lstrip("#")))
    return out


def test_relative_links_and_anchors_resolve():
    dead = []
    for page in PAGES:
        path = ROOT / page
        fenced = False
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                fenced = not fenced
                continue
            if fenced:
                continue
            for target in LINK.findall(line):
                if re.match(r"^[a-z]+://|^mailto:", target):
                    continue
                file, _, anchor = target.partition("#")
                dest = (path.parent / file).resolve() if file else path
                where = f"{os.path.relpath(path, ROOT)}:{n}: {target}"
                if not dest.exists():
                    dead.append(f"{where}: no such file")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                    dead.append(f"{where}: no heading #{anchor} in {os.path.relpath(dest, ROOT)}")
    assert not dead, "dead links in the docs:\n" + "\n".join(dead)


def test_every_doc_page_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    pages = [os.path.relpath(p, ROOT) for p in glob.glob(str(ROOT / "docs" / "*.md"))] + ["benchmarks/README.md"]
    unlinked = [p for p in pages if f"]({p}" not in readme]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_every_report_is_linked_from_the_benchmarks_readme():
    index = (ROOT / "benchmarks" / "README.md").read_text()
    reports = [os.path.basename(p) for p in glob.glob(str(ROOT / "benchmarks" / "reports" / "*.md"))]
    unlinked = [r for r in reports if f"](reports/{r})" not in index]
    assert not unlinked, f"reports benchmarks/README.md does not link: {unlinked}"


TEST_FILE = re.compile(r"\b(test_[a-z0-9_]+\.py)\b")
TEST_PATH = re.compile(r"(?<![\w/])tests/((?:[a-z_]+/)?test_[a-z0-9_]+\.py)\b")  # as the docs name it


def _tests_by_file() -> dict[str, set[str]]:
    out = {}
    for path in glob.glob(str(ROOT / "tests" / "*" / "test_*.py")):  # tests/GROUP/test_x.py, by file name
        text = Path(path).read_text()
        out[os.path.basename(path)] = set(re.findall(r"^\s*def (test_\w+)", text, flags=re.M))
    return out


def test_every_test_the_docs_name_exists():
    """The guides name tests as `FILE::test_name`, `FILE`, or a name prefix ending in `...`
    (docs/operations.md's guarantee table): each file exists and each name or prefix matches a
    test there (in any test file when no file is named in the same cell). The dated reports record
    what was run at the time and are not checked."""
    tests = _tests_by_file()
    every = set().union(*tests.values())
    missing = []
    pages = ["README.md", *glob.glob(str(ROOT / "docs" / "*.md")), "benchmarks/README.md"]
    for page in pages:
        path = ROOT / page
        for n, line in enumerate(path.read_text().splitlines(), 1):
            where = f"{os.path.relpath(path, ROOT)}:{n}"
            for cell in line.split("|") if line.startswith("|") else [line]:
                files = TEST_FILE.findall(cell)
                for f in files:
                    if f not in tests:
                        missing.append(f"{where}: no test file {f}")
                for rel in TEST_PATH.findall(cell):  # a path names the file where it is
                    if not (ROOT / "tests" / rel).is_file():
                        missing.append(f"{where}: no file tests/{rel}")
                for ref in re.findall(r"`([^`]*\btest_[a-z0-9_]+(?:\.\.\.)?)`", cell):
                    file, sep, name = ref.rpartition("::")
                    if not name.startswith("test_") or name.endswith(".py") or (file and not file.endswith(".py")):
                        continue
                    prefix = name.endswith("...")
                    if not (sep or prefix or files):  # a bare `test_auc` is a summary key, not a test
                        continue
                    name = name.rstrip(".")
                    file = os.path.basename(file) if file else (files[0] if len(files) == 1 else None)
                    pool = tests.get(file, set()) if file else every
                    if not any(t == name or (prefix and t.startswith(name)) for t in pool):
                        missing.append(f"{where}: no test {name}{'...' if prefix else ''} in "
                                       f"{'tests/' + file if file else 'tests/'}")
    assert not missing, "tests the docs name but the suite does not have:\n" + "\n".join(missing)
