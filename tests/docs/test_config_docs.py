"""Each config key is documented once (its field's comment in trainer/base/config/schema.py) and has one
default: the schema's, conf/'s and docs/config.md's reference agree, and a key or default that
differs between them fails naming the key.

What is checked: docs/config.md's generated part is what trainer/base/config/doc.py prints (the page is
regenerated, not edited); every key a YAML file of conf/ sets is a key of the schema, and the values
of each group's default option (and of conf/config.yaml's blocks) are the schema's defaults; the
page's reference lists every key with the schema's default; every key, group and option has its
doc; the YAML files hold values, not a second copy of the docs (no comment on a key's line). The
checker itself is tried on a copy of conf/ and a page with one drift each. In the prose of README.md
and docs/: every `key=value` names a key of the schema, and a default a sentence states is the
schema's.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.base.config import CONF_DIR, Config, doc

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "config.md"


def test_the_page_holds_the_generated_reference():
    assert doc.page_part(PAGE.read_text()) == doc.render(), (
        "docs/config.md's reference differs from trainer/base/config/doc.py's output: regenerate it "
        "(python -m trainer.base.config.doc --write) after changing a doc or default in the schema or conf/")


def test_schema_yaml_and_page_agree_on_every_key_and_default():
    problems = doc.drifts() + doc.page_drifts(PAGE.read_text())
    assert not problems, "\n".join(problems)


def test_every_key_group_and_option_has_its_doc():
    undocumented = [k.name for k in doc.keys() if not k.doc]
    assert not undocumented, f"keys without a doc comment in trainer/base/config/schema.py: {undocumented}"
    hints = __import__("typing").get_type_hints(Config)
    assert all(hints[g].__doc__ and not hints[g].__doc__.startswith(hints[g].__name__ + "(")
               for g in doc.groups()), "every group's dataclass needs a docstring"
    bare = [f"conf/{g}/{o}.yaml" for g in doc.groups() for o in doc.options(g) if not doc.option_doc(g, o)]
    assert not bare, f"options without a comment at the top of their file: {bare}"


def test_the_yaml_files_hold_values_not_docs():
    """A key's doc lives in the schema; a comment on a key's line in conf/ would be a second copy
    that drifts (conf/comm/*.yaml said "owners keep fp32" where the rows keep embedding.dtype).
    Hydra's own block is not ours to document and is left out."""
    commented = []
    for path in sorted(Path(CONF_DIR).rglob("*.yaml")):
        in_hydra = False
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.match(r"^\w", line):
                in_hydra = line.startswith("hydra:")
            if not in_hydra and re.match(r"^\s*[\w-]+:.*\s#", line):
                commented.append(f"{path.relative_to(CONF_DIR)}:{n}")
    assert not commented, f"comments on key lines (document the key in trainer/base/config/schema.py): {commented}"


def test_the_reference_lists_every_recipe_and_choice_the_schema_names():
    """The recipes (train.recipe) and the kinds of table, as examples of lists a comment once left
    out (conf/train/default.yaml's recipe comment had no `tiny`)."""
    from trainer.base.config import RECIPES, TABLE_KINDS
    docs = {k.name: k.doc for k in doc.keys()}
    assert all(r in docs["train.recipe"] for r in RECIPES), docs["train.recipe"]
    assert all(t in docs["embedding.kind"] for t in TABLE_KINDS), docs["embedding.kind"]


@pytest.fixture
def conf_copy(tmp_path):
    return Path(shutil.copytree(CONF_DIR, tmp_path / "conf"))


def _edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, (path, old)
    path.write_text(text.replace(old, new, 1))


def test_a_yaml_default_that_differs_from_the_schema_is_named(conf_copy):
    assert doc.drifts(str(conf_copy)) == []
    _edit(conf_copy / "train" / "default.yaml", "log_every: 10", "log_every: 20")
    _edit(conf_copy / "config.yaml", "keep_last: 3", "keep_last: 5")
    _edit(conf_copy / "data" / "tiny.yaml", "batch_size: 64", "batch_size: 32")
    _edit(conf_copy / "data" / "bench.yaml", "batch_size: 2048", "batch_size: 1024")  # another option: its own value
    _edit(conf_copy / "cache" / "lru.yaml", "pin_threshold: 8", "pin_threshold: 8\ncapacity: 3")
    found = doc.drifts(str(conf_copy))
    assert [line.split(":")[0] for line in found] == [
        "data.batch_size", "cache.capacity", "train.log_every", "checkpoint.keep_last"], found
    assert "cache.capacity: set in conf/cache/lru.yaml, not a key of the schema" in found
    assert "train.log_every: 20 in conf/train/default.yaml, 10 in the schema" in found[2]


def test_a_page_default_or_key_that_differs_from_the_schema_is_named():
    text = PAGE.read_text()
    assert doc.page_drifts(text) == []
    text = text.replace("| `train.log_every` | int | `10` |", "| `train.log_every` | int | `20` |")
    text = text.replace("| `comm.timeout_s` |", "| `comm.timeout` |")
    found = doc.page_drifts(text)
    assert "train.log_every: default 20 on the page, 10 in the schema" in found, found
    assert "comm.timeout_s: missing from the page" in found and \
        "comm.timeout: on the page, not a key of the schema" in found, found


def test_the_command_checks_and_rewrites_the_page(tmp_path):
    page = tmp_path / "config.md"
    page.write_text(f"# intro\n\n{doc.BEGIN}\nstale\n{doc.END}\n\n## after\n")
    run = [sys.executable, "-m", "trainer.base.config.doc"]
    stale = subprocess.run(run + ["--check", str(page)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert stale.returncode == 1 and "train.steps: missing from the page" in stale.stderr, stale.stderr
    subprocess.run(run + ["--write", str(page)], check=True, capture_output=True, timeout=120, cwd=ROOT)
    fresh = subprocess.run(run + ["--check", str(page)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert fresh.returncode == 0, fresh.stderr
    text = page.read_text()
    assert text.startswith("# intro\n") and text.endswith("## after\n") and doc.page_part(text) == doc.render()


# ---------------------------------------------------------------- the prose of README.md and docs/
PROSE = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")), "benchmarks/README.md"]
_KEY = r"(?:%s)\.[\w.]+" % "|".join(doc.groups())
OVERRIDE = re.compile(rf"(?<![\w.])\+?({_KEY}|(?:cache|consistency)\.tables\.\w+\.\w+)=")
# `key=value` (the default) | `key=value`, the default) ... and `key` (default `value` | `key=a|b` (default value
SAID_DEFAULT = re.compile(rf"`({_KEY})=([^`|]+)`(?: \(the default\)|, the default[),.;])")
SAID_DEFAULT_OF = re.compile(rf"`({_KEY})(?:=[^`]*)?`[^()`]{{0,3}}\(default:? `?([\w.+-]+)`?(?: (MiB|GiB|s)\b)?")


def _same(said: str, default, unit: str | None = None) -> bool:
    scale = {"MiB": 1 << 20, "GiB": 1 << 30}.get(unit or "", 1)
    try:
        return float(said) * scale == float(default)
    except (TypeError, ValueError):
        return said == doc.yaml_value(default)


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def test_every_key_the_docs_override_is_a_key_of_the_schema():
    """A renamed or removed key leaves no command or sentence behind (`+cache.tables.0.capacity_rows=`
    counts as its per-table entry)."""
    known = {k.name for k in doc.keys()}
    stale = []
    for rel in PROSE:
        text = (ROOT / rel).read_text()
        for m in OVERRIDE.finditer(text):
            key = re.sub(r"\.tables\.\w+\.", ".tables.<t>.", m.group(1))
            if key not in known:
                stale.append(f"{rel}:{_line(text, m.start())}: {m.group(1)}")
    assert not stale, f"overrides of keys the schema does not have: {stale}"


def test_a_default_the_prose_states_is_the_schemas():
    """`train.pipeline=ids` (the default), `comm.timeout_s` (default 60 s), ...: where a page says
    a key's default, it is the schema's."""
    defaults = {k.name: k.default for k in doc.keys()}
    said, wrong = 0, []
    for rel in PROSE:
        text = (ROOT / rel).read_text()
        for m in [*SAID_DEFAULT.finditer(text), *SAID_DEFAULT_OF.finditer(text)]:
            key, value = m.group(1), m.group(2).strip()
            unit = m.group(3) if m.re is SAID_DEFAULT_OF else None
            said += 1
            if key not in defaults or not _same(value, defaults[key], unit):
                wrong.append(f"{rel}:{_line(text, m.start())}: {key} default {value}"
                             f"{' ' + unit if unit else ''}, the schema's is {doc.yaml_value(defaults.get(key))}")
    assert said >= 10, said  # the patterns still find the docs' wording
    assert not wrong, "\n".join(wrong)


def test_the_recipe_page_holds_the_generated_table(tmp_path):
    """docs/recipe.md's table of recipe values is trainer/run/resolve/recipe_doc.py's output (generated from
    recipes.py), and the checker fails on a page whose table drifted."""
    from trainer.run.resolve import recipe_doc
    page = ROOT / "docs" / "recipe.md"
    assert recipe_doc.page_part(page.read_text()) == recipe_doc.render(), (
        "docs/recipe.md's table differs from trainer/run/resolve/recipes.py: python -m trainer.run.resolve.recipe_doc --write")
    drifted = tmp_path / "recipe.md"
    drifted.write_text(page.read_text().replace("| `data.epochs` | `30` |", "| `data.epochs` | `20` |"))
    assert drifted.read_text() != page.read_text()
    assert recipe_doc.main(["--check", str(drifted)]) == 1
    assert recipe_doc.main(["--write", str(drifted)]) == 0 and recipe_doc.main(["--check", str(drifted)]) == 0
