import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
TESTS = os.path.dirname(os.path.abspath(__file__))
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)
# Subprocesses (scripts, `python -m trainer`, launchers) import this checkout too, whatever their
# working directory: the venv's editable install may point at another checkout (a git worktree).
if os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] != ROOT:
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (.ci/run: `-n 2 --dist loadgroup`), tests are grouped: a file's tests run
    in one worker, in their order (a module's fixtures are built once; the docs' command blocks,
    independent of each other, are spread one by one), and every test that builds
    network namespaces or containers runs in one worker (they share host-wide names: emulated
    hosts, bridges, images). Without xdist the marks change nothing."""
    for item in items:
        host_wide = item.get_closest_marker("netns") or item.get_closest_marker("docker")
        group = item.nodeid.split("::")[0]
        if "test_documented_commands_run[" in item.nodeid:  # the docs' blocks are independent: ~12 min as one
            group = item.nodeid
        item.add_marker(pytest.mark.xdist_group("host-wide" if host_wide else group))
