"""scripts/check_imports.py: the static import graph of trainer/ and kernels/ and their cycles; what
the installed package holds.

What is asserted: neither package has an import cycle, even counting imports made for type checkers
only; trainer/base/config/ imports nothing else of the package (a leaf); the simulator's engine
(trainer/sparse/sim/) imports only trainer/sparse/embedding; training never imports trainer/tools; every module of
the two packages imports on its own and none of them loads the repository's benchmarks/ or dev/
(the lab lives beside the package, not in it). The checker itself is tested on a small package with
known cycles (module level, inside a function, relative imports, TYPE_CHECKING left out by default).

And the tests' own rule: no file under tests/ imports a test module (test_*.py); what several test
files share lives in a helper module at tests/ root (helpers.py, parity_helpers.py, ...).
"""
from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "check_imports.py")
TRAINER = os.path.join(ROOT, "trainer")
KERNELS = os.path.join(ROOT, "kernels")
TESTS = os.path.join(ROOT, "tests")


def _checker():
    spec = importlib.util.spec_from_file_location("check_imports", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


check = _checker()


def _package(root, files: dict[str, str]) -> str:
    pkg = root / "pkg"
    for rel, text in files.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return str(pkg)


def test_config_is_a_leaf():
    graph = check.import_graph(TRAINER)
    assert "trainer.base.config" in graph and "trainer.run.resolve.configure" in graph
    config = {m: deps for m, deps in graph.items() if m == "trainer.base.config" or m.startswith("trainer.base.config.")}
    outside = {m: [d for d in deps if d != "trainer.base.config" and not d.startswith("trainer.base.config.")]
               for m, deps in config.items()}
    assert not any(outside.values()), outside


def test_data_and_config_share_no_cycle():
    cycles = check.find_cycles(TRAINER)
    for comp in cycles:
        assert not {"trainer.base.config", "trainer.workload.data"} & set(comp), comp
    graph = check.import_graph(TRAINER)
    assert "trainer.base.config" in graph["trainer.workload.data"]  # data uses the schemas, never the reverse
    assert "trainer.workload.data" in graph["trainer.run.resolve.configure"] and "trainer.base.config" in graph["trainer.run.resolve.configure"]


def test_every_import_keeps_to_the_layers():
    """The trainer's components (docs/design.md's map): a lower layer never imports a higher one,
    and every component has its layer."""
    files = check.module_files(TRAINER)
    assert check.layer_violations(check.import_graph(TRAINER), check.LAYERS["trainer"], files, ROOT) == []
    placed = {c for layer in check.LAYERS["trainer"] for c in layer}
    assert {check.component(m) for m in files} == placed  # no layer names a component that is gone


def test_the_folders_are_the_layers():
    """trainer/'s top is its tiers: each top folder is one layer of check_imports.LAYERS, the imports
    stack each on its own floor (base 0 ... tools 5: no tier skips the one under it, none reaches
    up), at most 7 folders and 3 loose modules."""
    top = sorted(os.listdir(TRAINER))
    folders = [d for d in top if os.path.isfile(os.path.join(TRAINER, d, "__init__.py"))]
    loose = [f for f in top if f.endswith(".py")]
    assert len(folders) <= 7 and len(loose) <= 3, (folders, loose)
    layers = check.LAYERS["trainer"]
    assert {c for names in layers for c in names if c and not c.startswith("__")} == set(folders)
    graph = check.import_graph(TRAINER)
    assert check.drawn_wrong(graph, layers) == []
    floors = check.floors(graph)
    assert [floors[names[0]] for names in layers] == list(range(len(layers)))


def test_files_and_folders_stay_readable():
    """No module of trainer/ or kernels/ over 500 lines (split by responsibility, not by count: one
    idea per file); embedding/'s top at most 12 files, its features in their folders (store/,
    cache/, dynamic/, remote/)."""
    long = []
    for top in (TRAINER, KERNELS):
        for folder, _, files in os.walk(top):
            for f in files:
                if f.endswith(".py"):
                    with open(os.path.join(folder, f), encoding="utf-8") as fh:
                        n = sum(1 for _ in fh)
                    if n > 500:
                        long.append((os.path.relpath(os.path.join(folder, f), ROOT), n))
    assert long == []
    emb = os.path.join(TRAINER, "sparse", "embedding")
    entries = [e for e in os.listdir(emb) if e != "__pycache__"]
    assert len(entries) <= 12, sorted(entries)
    assert {"store", "cache", "dynamic", "remote"} <= {e for e in entries if os.path.isdir(os.path.join(emb, e))}


def test_the_data_shape_and_the_recipe_are_resolved_in_one_place():
    """Reading a file dataset's shape and choosing the recipe happen once, in load_config
    (trainer/run/resolve/configure.py); everything after it reads the config's `resolved`."""
    calls: dict[str, list[str]] = {"shape_of": [], "choose_recipe": []}
    for folder, _, files in os.walk(TRAINER):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(folder, f)
            with open(path, encoding="utf-8") as fh:
                tree = ast.parse(fh.read())
            for node in ast.walk(tree):
                if isinstance(node, ast.Call):
                    name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                    if name in calls:
                        calls[name].append(os.path.relpath(path, ROOT))
    assert calls == {"shape_of": ["trainer/run/resolve/configure.py"],
                     "choose_recipe": ["trainer/run/resolve/configure.py"]}


def test_the_step_calls_no_collective_of_the_sparse_side():
    """The sparse half of a step is the embedding's (trainer/sparse/embedding/: HybridEmbedding, its
    exact-size mode; fixed/shapes.py, its fixed-shape mode): trainer/step/ keeps the dense half, the
    precision and the capture, and calls no alltoall, nor a lookup plan or an owner's update."""
    sparse_only = {"alltoall", "alltoall_async", "exchange_splits_async", "plan_lookup", "padded_plan",
                   "padded_request", "padded_combine", "apply_masked", "reduce_replica"}
    found = []
    step = os.path.join(TRAINER, "step")
    for f in sorted(os.listdir(step)):
        if not f.endswith(".py"):
            continue
        with open(os.path.join(step, f), encoding="utf-8") as fh:
            tree = ast.parse(fh.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name in sparse_only:
                    found.append(f"trainer/step/{f}:{node.lineno}: {name}")
    assert not found, found


def test_floors_are_drawn_from_the_imports(tmp_path):
    pkg = _package(tmp_path, {
        "__init__.py": "",
        "a/__init__.py": "",
        "b/__init__.py": "from ..a import x\n",
        "c/__init__.py": "from ..a import x\n",  # skips b: on floor 1, declared 2
        "a/x.py": "",
    })
    graph = check.import_graph(pkg)
    assert check.floors(graph) == {"a": 0, "b": 1, "c": 1}
    assert check.drawn_wrong(graph, [("a",), ("b",), ("c",)]) == [
        "component 'c': declared layer 2, its imports stack it on floor 1"]


def test_trainer_calls_the_kernels_through_their_package(tmp_path):
    """No trainer module imports a file under kernels/ (kernels/__init__ is their public API)."""
    assert check.api_bypasses(TRAINER, "kernels") == []
    _package(tmp_path, {"__init__.py": "", "x.py": "from api import sub\nfrom api.sub import f\nimport api\n"})
    api = tmp_path / "api"
    api.mkdir()
    (api / "__init__.py").write_text("")
    (api / "sub.py").write_text("")
    assert len(check.api_bypasses(str(tmp_path / "pkg"), "api")) == 2


def test_layer_violations_are_reported_with_file_and_line(tmp_path):
    pkg = _package(tmp_path, {
        "__init__.py": "",
        "low/__init__.py": "",
        "low/a.py": "from ..high import b\n",  # up a layer: reported
        "high/__init__.py": "",
        "high/b.py": "from ..low import a\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .. import odd\n",
        "odd.py": "",
    })
    files = check.module_files(pkg)
    got = check.layer_violations(check.import_graph(pkg), [("low",), ("high",)], files, str(tmp_path))
    assert got == ["pkg.odd: component 'odd' is in no layer of check_imports.LAYERS",
                   "pkg: component '' is in no layer of check_imports.LAYERS",
                   "pkg.low.a -> pkg.high.b: layer 0 (low) imports layer 1 (high)    (pkg/low/a.py:1)"], got


def test_no_import_cycle_anywhere():
    for package in (TRAINER, KERNELS):
        assert check.find_cycles(package) == [], package
        assert check.find_cycles(package, types=True) == [], package  # type-only imports too


def test_every_module_of_the_package_imports_and_none_is_the_lab():
    """Each module of trainer/ and kernels/ imported alone (a fresh interpreter for all, in order);
    none of them pulls in benchmarks/ or dev/, and neither package holds a benchmark, a study or
    the cluster emulation by name."""
    names = sorted(m for d in (TRAINER, KERNELS) for m in check.module_files(d))
    lab = ("bench", "soak", "netcluster", "gpu_parity", "phases", "splits", "rotations", "paired")
    assert not [m for m in names if any(w in m.rsplit(".", 1)[-1] for w in lab)], names
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'benchmarks', 'dev'}))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", proc.stdout


def test_simulator_engine_imports_only_the_embedding():
    graph = check.import_graph(TRAINER)
    used = {t for m, edges in graph.items() if m.startswith("trainer.sparse.sim") for t in edges}
    outside = {t for t in used if t.startswith("trainer.") and not t.startswith(("trainer.sparse.sim", "trainer.sparse.embedding"))}
    assert outside == set(), outside
    assert any(t.startswith("trainer.sparse.embedding.remote") for t in used)


def test_training_never_imports_the_tools():
    graph = check.import_graph(TRAINER)
    users = {m for m, edges in graph.items() if any(t.startswith("trainer.tools") for t in edges)}
    # the command line (python -m trainer) included: the error-line format it shares with the
    # tools is trainer/base/core/errors.py's
    assert users <= {m for m in graph if m.startswith("trainer.tools")}, users


def test_checker_finds_cycles_of_every_kind(tmp_path):
    pkg = _package(tmp_path, {
        "__init__.py": "",
        "a.py": "from . import b\n",
        "b.py": "def f():\n    from .sub.c import g\n    return g\n",  # inside a function
        "sub/__init__.py": "",
        "sub/c.py": "from ..a import x\nx = 1\n",  # relative, two levels up
        "d.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import e\n"
                "else:\n    import pkg.f\n",
        "e.py": "from .d import y\n",  # d -> e only for type checkers: no cycle
        "f.py": "import pkg.f\n",  # a module importing itself
        "leaf.py": "import os\nimport json\n",
    })
    assert check.find_cycles(pkg) == [["pkg.a", "pkg.b", "pkg.sub.c"], ["pkg.f"]]
    assert check.find_cycles(pkg, types=True) == [["pkg.a", "pkg.b", "pkg.sub.c"], ["pkg.d", "pkg.e"], ["pkg.f"]]
    graph = check.import_graph(pkg)
    assert graph["pkg.d"] == {"pkg.f": [5]} and graph["pkg.e"] == {"pkg.d": [1]}
    assert graph["pkg.b"] == {"pkg.sub.c": [2]} and graph["pkg.leaf"] == {}
    assert check.closed_path(graph, ["pkg.a", "pkg.b", "pkg.sub.c"]) == ["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]


def test_cli_reports_cycles_and_exit_status(tmp_path):
    clean = _package(tmp_path / "clean", {"__init__.py": "", "a.py": "from . import b\n", "b.py": "x = 1\n"})
    proc = subprocess.run([sys.executable, SCRIPT, clean], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "no import cycle" in proc.stdout, proc.stdout + proc.stderr
    loop = _package(tmp_path / "loop", {"__init__.py": "", "a.py": "from .b import y\nx = 1\n",
                                        "b.py": "def f():\n    from .a import x\n"})
    proc = subprocess.run([sys.executable, SCRIPT, loop], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "cycle 1: 2 module(s): pkg.a, pkg.b" in proc.stdout
    assert "pkg.a -> pkg.b" in proc.stdout and "pkg.b -> pkg.a    (pkg/b.py:2)" in proc.stdout
    proc = subprocess.run([sys.executable, SCRIPT, str(tmp_path / "nope")], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("error:")


def test_cli_on_the_repository_checks_both_packages():
    proc = subprocess.run([sys.executable, SCRIPT, "--types"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "trainer: no import cycle" in proc.stdout and "kernels: no import cycle" in proc.stdout, proc.stdout


def test_importing_config_loads_nothing_else_of_the_package():
    code = ("import sys, trainer.base.config; "
            "print(sorted(m for m in sys.modules if m.startswith('trainer.')))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    loaded = ast.literal_eval(proc.stdout.strip())
    assert "trainer.base.config" in loaded and all(m == "trainer.base" or m.startswith("trainer.base.config") for m in loaded), loaded


def _is_test_module(name: str) -> bool:
    return any(part.startswith("test_") for part in name.split("."))


def imported_test_modules(path: str) -> list[str]:
    """'line: name' for every test module (a dotted part named test_*) the Python file at `path`
    imports, in line order: import and from-import statements at any depth (a function's too),
    relative ones, importlib.import_module and __import__ of a literal name. A from-import of a
    test_* name counts too (a test module, or a test function pytest would collect again)."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            names = [base] if _is_test_module(base) else \
                [f"{base}.{a.name}" if node.module else base + a.name for a in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and \
                isinstance(node.args[0].value, str) and \
                (getattr(node.func, "id", None) == "__import__" or getattr(node.func, "attr", None) == "import_module"):
            names = [node.args[0].value]
        found += [(node.lineno, n) for n in names if _is_test_module(n)]
    return [f"{line}: {name}" for line, name in sorted(found)]


def test_no_test_file_imports_another():
    """Every check, hook or config several test files share is in a helper module at tests/ root
    (helpers.py, parity_helpers.py, dynamic_helpers.py, ...), never imported from a test file:
    importing test_parity from test_cache couples the two files and hides where the check lives."""
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(TESTS) for f in fs if f.endswith(".py"))
    assert os.path.join(TESTS, "distributed", "test_parity.py") in files
    found = [f"{os.path.relpath(path, ROOT)}:{hit}" for path in files for hit in imported_test_modules(path)]
    assert not found, "test modules imported (move what they share to a helper module at tests/ root):\n" + \
        "\n".join(found)


def test_the_test_import_check_sees_every_form(tmp_path):
    path = tmp_path / "test_x.py"
    path.write_text(textwrap.dedent("""\
        import os, test_a
        from test_b import BASE, check
        from tests.unit import test_c
        from . import test_d

        def f():
            import importlib
            from test_e import g
            return importlib.import_module("test_f"), __import__("test_g")

        import helpers, parity_helpers, pytest_timeout, testing
        from helpers import assert_same_eval, test_like
        """))
    assert imported_test_modules(str(path)) == ["1: test_a", "2: test_b", "3: tests.unit.test_c", "4: .test_d",
                                                "8: test_e", "9: test_f", "9: test_g", "12: helpers.test_like"]


def test_the_seams_are_typed():
    """What the loop, the scheduler and the evaluation call on data is a declared protocol
    (workload/data/source.py), never `data: Any`; HET's wire is a VersionWire."""
    untyped = []
    for folder, _, files in os.walk(TRAINER):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(folder, f), encoding="utf-8") as fh:
                    untyped += [f"{f}:{i}" for i, line in enumerate(fh, 1)
                                if "data: Any" in line or "wire: Any" in line]
    assert untyped == []
