import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
TESTS = os.path.dirname(os.path.abspath(__file__))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
# tests/ holds the shared helpers (helpers.py, parity_helpers.py, data_helpers.py, ...), importable
# from any test and its workers; its groups (unit/, distributed/, kernels/, docs/, tools/) hold the
# test files, which import no other test file (tests/docs/test_imports.py): pytest puts each test
# file's own directory on sys.path, and no group needs another's
# Subprocesses (scripts, `python -m trainer`, launchers) import this checkout too, whatever their
# working directory: the venv's editable install may point at another checkout (a git worktree).
if os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] != ROOT:
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)


# ---- fixtures the checkpoint, output-directory and data-error tests share ----------------------
# (real tmpfs mounts: root ignores permission bits, so a read-only mount is the only refusal root gets)

@pytest.fixture
def small_fs(tmp_path):
    """A small file system to fill (tests/helpers.py tmpfs)."""
    from helpers import tmpfs

    with tmpfs(tmp_path / "small") as mnt:
        yield mnt


@pytest.fixture
def read_only(tmp_path):
    """A read-only directory holding an `out` directory."""
    from helpers import tmpfs

    with tmpfs(tmp_path / "ro", dirs=("out",), read_only=True) as mnt:
        yield mnt


@pytest.fixture
def read_only_path(tmp_path):
    """A read-only directory holding an `inside` directory, as a Path."""
    from pathlib import Path

    from helpers import tmpfs

    with tmpfs(tmp_path / "ro", dirs=("inside",), read_only=True) as mnt:
        yield Path(mnt)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> str:
    """The suite's Criteo-format sample, prepared once per module (train: the first 1,600 rows, test: the
    rest; 1,000 rows per table); a module may define its own `prepared`."""
    from data_helpers import prepared_dir

    return prepared_dir(tmp_path_factory, "criteo")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """One complete W = 1 checkpoint (adagrad) at step 3, never modified by tests (copy it)."""
    from failure_helpers import BASE, _step
    from helpers import run_single

    root = str(tmp_path_factory.mktemp("saved"))
    run_single(BASE + ["train.steps=3", "optim=adagrad", f"checkpoint.dir={root}"])
    return _step(root, 3)


@pytest.fixture(scope="session")
def sample_file(tmp_path_factory) -> str:
    """The suite's own sample (1,999 made-up rows in Criteo's raw format) as a file."""
    from data_helpers import write_sample

    return write_sample(str(tmp_path_factory.mktemp("sample") / "criteo_format_sample.tsv"))


@pytest.fixture(scope="session")
def criteo_sample() -> str:
    """The path of the real Criteo sample (data_helpers.real_sample_path); the test is skipped,
    naming the variable, without it. Every other test runs on files the suite makes itself."""
    from data_helpers import CRITEO_SAMPLE_ENV, real_sample_path

    path = real_sample_path()
    if not os.path.isfile(path):
        pytest.skip(f"the real Criteo sample is not at {path}: set {CRITEO_SAMPLE_ENV} to a copy of "
                    "the 2k-row Criteo sample (Criteo Kaggle rows, raw TSV) to run this test")
    return path


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (.ci/run: `-n 2 --dist loadgroup`), tests are grouped: a file's tests run
    in one worker, in their order (a module's fixtures are built once; the docs' command blocks,
    independent of each other, are spread one by one), and every test that builds
    network namespaces or containers runs in one worker (they share host-wide names: emulated
    hosts, bridges, images). Without xdist the marks change nothing. A test that reads the real
    Criteo sample (the criteo_sample fixture) is marked real_sample. A gpu-marked test is skipped
    where no CUDA device is visible (the README's `pytest -q` runs everywhere)."""
    import torch

    no_gpu = None if torch.cuda.is_available() else pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if no_gpu is not None and item.get_closest_marker("gpu"):
            item.add_marker(no_gpu)
        host_wide = item.get_closest_marker("netns") or item.get_closest_marker("docker")
        group = item.nodeid.split("::")[0]
        if "test_documented_commands_run[" in item.nodeid:  # the docs' blocks are independent: ~12 min as one
            group = item.nodeid
        item.add_marker(pytest.mark.xdist_group("host-wide" if host_wide else group))
        if "criteo_sample" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.real_sample)
