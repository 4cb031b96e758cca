"""Installable: the wheel holds the trainer, its configs and its commands, and trains from any
directory after a plain (non-editable) install.

- pyproject.toml lists every package directory of trainer/ and kernels/, and ships conf/ as
  trainer/conf/;
- the README's `pip wheel --no-deps .` and `pip install .`, as printed (docs_registry.documented),
  in a copy of the checkout: the wheel holds the configs, and the install into a fresh virtual
  environment (its dependencies come from this one, through a .pth line that does not run this
  environment's editable-install hook; pip without an index) trains from a directory outside the
  checkout with the README's `hybrid-trainer model=dcn` and `python -m trainer`;
  `hybrid-trainer-prepare-criteo` prepares rows that `hybrid-trainer data=criteo` then trains on;
  every module of the installed package imports, from the installed copy, and loads nothing of
  benchmarks/ or dev/;
- another distribution's `kernels` (or `trainer`) in the way stops the command with one line naming
  it, before anything else is imported.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

from data_helpers import sample_lines
from docs_registry import documented

ROOT = Path(__file__).resolve().parents[2]


def _pyproject() -> dict:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def test_the_package_list_is_every_package_directory():
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    found = {str(p.parent.relative_to(ROOT)).replace(os.sep, ".")
             for top in ("trainer", "kernels") for p in (ROOT / top).rglob("__init__.py")}
    assert listed == found | {"trainer.conf"}, (sorted(listed - found), sorted(found - listed))
    assert _pyproject()["tool"]["setuptools"]["package-dir"] == {"trainer.conf": "conf"}


def test_every_tool_extra_is_in_the_test_extra_and_no_dependency():
    """scikit-learn and matplotlib are extras (`baseline`, `plot`: only their tools import them,
    trainer.tools.cli.EXTRAS says which); the test extra, which setup.sh and the image install,
    holds every extra's requirements."""
    from trainer.tools.cli import EXTRAS

    project = _pyproject()["project"]
    extras = project["optional-dependencies"]
    assert set(EXTRAS) <= set(extras), (sorted(EXTRAS), sorted(extras))
    for name in EXTRAS:
        assert set(extras[name]) <= set(extras["test"]), (name, extras[name])
    names = [re.split(r"[<>=;\[ ]", r, maxsplit=1)[0] for r in project["dependencies"]]
    assert not {"scikit-learn", "matplotlib"} & set(names), names


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without the checkout on PYTHONPATH (the installed copy must be
    the one that runs)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, **extra}


def _run(cmd: list[str], cwd, timeout: float = 300, **extra: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=_clean_env(**extra), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd}: rc={proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


# pip without a package index: the project's dependencies (and the build backend, setuptools) are
# this environment's, on the fresh one's path by a .pth line, so `pip install .` finds them there.
OFFLINE_PIP = {"PIP_NO_INDEX": "1", "PIP_NO_BUILD_ISOLATION": "false", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The README's two ways, as printed, in a copy of the checkout: `pip wheel --no-deps .` (the
    wheel holds the configs and none of benchmarks/, dev/, tests/, scripts/) and `pip install .`
    into a fresh virtual environment whose dependencies are this one's site-packages (a .pth line;
    its own older setuptools removed so this one's builds the project)."""
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "*.egg-info", "build",
                                                             "dist", "outputs", "runs", "multirun", ".pytest_cache"))
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=tmp)
    py = venv / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "project_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([str(py), "-m", "pip", "uninstall", "-q", "-y", "setuptools"], cwd=tmp, **OFFLINE_PIP)
    _run(documented("pip wheel --no-deps .", bin_dir=str(venv / "bin")), cwd=src, **OFFLINE_PIP)
    wheels = list(src.glob("hybrid_trainer-*.whl"))
    assert len(wheels) == 1, wheels
    names = zipfile.ZipFile(wheels[0]).namelist()
    shipped = sorted(n[len("trainer/conf/"):] for n in names if n.startswith("trainer/conf/"))
    assert shipped == sorted(str(p.relative_to(ROOT / "conf")) for p in (ROOT / "conf").rglob("*.yaml"))
    assert not [n for n in names if n.startswith(("benchmarks/", "dev/", "tests/", "scripts/"))]
    _run(documented("pip install .", bin_dir=str(venv / "bin")), cwd=src, **OFFLINE_PIP)
    shutil.rmtree(src)  # the installed copy, not the sources, must be what runs
    return venv


def test_the_wheel_trains_from_any_directory(installed, tmp_path):
    bin_ = installed / "bin"
    where = _run([str(bin_ / "python"), "-c", "import trainer, trainer.base.config as c; print(trainer.__file__); "
                  "print(c.CONF_DIR)"], cwd=tmp_path).stdout.split()
    assert all(p.startswith(str(installed)) for p in where), where  # the installed copy, its configs
    out = _run(documented("hybrid-trainer model=dcn", bin_dir=str(bin_)), cwd=tmp_path)
    path = re.search(r"(?m)^summary: (\S+)$", out.stdout).group(1)
    summary = json.loads((tmp_path / path).read_text())
    assert summary["config"]["model"]["name"] == "dcn" and summary["steps"] == 3
    _run([str(bin_ / "python"), "-m", "trainer", "optim=adam", "train.steps=2", "data.test_samples=256",
          "train.progress=off", f"hydra.run.dir={tmp_path / 'run2'}"], cwd=tmp_path)
    assert json.loads((tmp_path / "run2" / "summary.json").read_text())["config"]["optim"]["dense"] == "adam"


def test_the_installed_commands_prepare_and_train_criteo(installed, tmp_path):
    bin_ = installed / "bin"
    lines = sample_lines()
    (tmp_path / "TRAIN.tsv").write_text("".join(lines[:400]))
    (tmp_path / "TEST.tsv").write_text("".join(lines[1800:1900]))
    _run(documented("hybrid-trainer-prepare-criteo --train TRAIN.tsv --test TEST.tsv --out DIR", bin_dir=str(bin_)),
         cwd=tmp_path)
    _run([str(bin_ / "hybrid-trainer"), "data=criteo", "data.dir=DIR", "data.epochs=1", "train.progress=off",
          f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["test_auc"] is not None
    out = _run(documented("hybrid-trainer-plot-sweep --help", bin_dir=str(bin_)), cwd=tmp_path).stdout
    assert "usage: hybrid-trainer-plot-sweep" in out


def test_every_module_of_the_installed_package_imports(installed, tmp_path):
    code = ("import importlib, pkgutil, sys, trainer, kernels\n"
            "names = [m.name for p in (trainer, kernels) for m in pkgutil.walk_packages(p.__path__, p.__name__ + '.')]\n"
            "for n in names: importlib.import_module(n)\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('benchmarks', 'dev')]\n"
            "outside = [n for n in names if not sys.modules[n].__file__.startswith(sys.prefix)]\n"
            "print(len(names), bad, outside)\n")
    count, bad, outside = _run([str(installed / "bin" / "python"), "-c", code], cwd=tmp_path).stdout.split(" ", 2)
    assert int(count) > 60 and bad == "[]" and outside.strip() == "[]", (count, bad, outside)


def test_another_distributions_kernels_is_refused(tmp_path):
    """A `kernels` package without our mark ahead on the path (as Hugging Face's kernels installed
    over ours would be): one error line naming it, exit 2, nothing run."""
    fake = tmp_path / "other" / "kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('"""Not hybrid-trainer\'s."""\n')
    proc = subprocess.run([sys.executable, "-m", "trainer", "train.steps=1"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": f"{tmp_path / 'other'}{os.pathsep}{ROOT}"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: the package 'kernels' at {fake} is not hybrid-trainer's")
    assert "its own virtual environment" in err[0] and not (tmp_path / "outputs").exists()
