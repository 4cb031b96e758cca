"""docs/config.md's key reference, generated from the schema and conf/: every key with its type,
default and doc, every group with its options.

Why generated: a key is documented once, by the comment on its field's line in schema.py (and a
group by its dataclass's docstring, an option by the comment at the top of its conf/ file); the
page is written from them, so it cannot drift. tests/docs/test_config_docs.py checks that the page holds
what this module prints, and that the schema's defaults are the values conf/ composes.

    python -m trainer.base.config.doc                      # print the reference
    python -m trainer.base.config.doc --check docs/config.md   # exit 1 (naming the keys) if the page differs
    python -m trainer.base.config.doc --write docs/config.md   # rewrite the page's generated part

Here, not in scripts/: it reads only the schema and conf/ (config/ is the package's bottom layer and
imports nothing else of it), and `python -m` runs it from a checkout or an installed package alike.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import glob
import io
import os
import re
import sys
import tokenize
import typing
from typing import Any, Iterator, Optional

from omegaconf import OmegaConf

from . import schema
from .load import CONF_DIR, RENAMED
from .schema import Config

BEGIN = ("<!-- BEGIN generated reference: written by python -m trainer.base.config.doc --write from "
         "trainer/base/config/schema.py (a key's doc and default) and conf/ (options); edit those, not this part -->")
END = "<!-- END generated reference -->"
PAGE = "docs/config.md"
BLOCKS = ("embedding", "kernels", "checkpoint")  # blocks of conf/config.yaml (no group of files)


@dataclasses.dataclass(frozen=True)
class Key:
    """One key of the reference: its dotted name, type, schema default and doc."""

    name: str  # data.batch_size; per-table entries as cache.tables.<t>.capacity_rows
    type: str  # int, float or null, list[int], ...
    default: Any  # the dataclass default (None for a per-table entry: it inherits)
    doc: str  # the comment on the field's line in schema.py


def field_docs(path: Optional[str] = None) -> dict[str, dict[str, str]]:
    """{class name: {field: the comment on its line}} of the dataclasses in schema.py (a field
    without a comment maps to "")."""
    path = path or schema.__file__
    text = open(path, encoding="utf-8").read()
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(text).readline) if tok.type == tokenize.COMMENT}
    out: dict[str, dict[str, str]] = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.ClassDef):
            out[node.name] = {f.target.id: comments.get(f.end_lineno, "") for f in node.body
                              if isinstance(f, ast.AnnAssign) and isinstance(f.target, ast.Name)}
    return out


def _type_name(t: Any) -> str:
    args = typing.get_args(t)
    if typing.get_origin(t) is typing.Union and type(None) in args:
        inner = [a for a in args if a is not type(None)]
        return f"{_type_name(inner[0])} or null"
    if typing.get_origin(t) is list:
        return f"list[{_type_name(args[0])}]"
    return getattr(t, "__name__", str(t))


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def keys(cls: type = Config, prefix: str = "", docs: Optional[dict[str, dict[str, str]]] = None) -> Iterator[Key]:
    """Every key of the schema below `cls`, in field order: a nested block's keys (train.early_stop.*)
    in its place; a per-table map (cache.tables) as itself and its entries' keys (<t> = table index)."""
    docs = field_docs() if docs is None else docs
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        t, name = hints[f.name], f"{prefix}{f.name}"
        if dataclasses.is_dataclass(t):
            if prefix:  # a block inside a group: listed as a key of its own, then its keys
                yield Key(name, "block", None, docs[cls.__name__][f.name])
            yield from keys(t, f"{name}.", docs)
        elif typing.get_origin(t) is dict:
            entry = typing.get_args(t)[1]
            yield Key(name, "map", _default(f), docs[cls.__name__][f.name])
            for g in dataclasses.fields(entry):
                yield Key(f"{name}.<t>.{g.name}", _type_name(typing.get_type_hints(entry)[g.name]), _default(g),
                          docs[entry.__name__][g.name])
        else:
            yield Key(name, _type_name(t), _default(f), docs[cls.__name__][f.name])


def yaml_value(v: Any) -> str:
    """A value as conf/ writes it (null, true, 0.1, [64, 32], {})."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(yaml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {yaml_value(x)}" for k, x in v.items()) + "}"
    return str(v)


# ---------------------------------------------------------------- conf/: groups, options, values
def groups() -> list[str]:
    """The top-level keys of the schema in order: the Hydra groups and the blocks of config.yaml."""
    return [f.name for f in dataclasses.fields(Config)]


def default_options(conf_dir: str = CONF_DIR) -> dict[str, str]:
    """{group: its default option} from conf/config.yaml's defaults list."""
    out = {}
    for item in OmegaConf.to_container(OmegaConf.load(os.path.join(conf_dir, "config.yaml")))["defaults"]:
        if isinstance(item, dict):
            (k, v), = item.items()
            if not k.startswith("override "):
                out[k] = v
    return out


def options(group: str, conf_dir: str = CONF_DIR) -> list[str]:
    """The options of a group (conf/<group>/*.yaml), the default first; [] for a block."""
    names = sorted(os.path.basename(p)[:-5] for p in glob.glob(os.path.join(conf_dir, group, "*.yaml")))
    first = default_options(conf_dir).get(group)
    return sorted(names, key=lambda n: n != first)


def option_values(group: str, option: str, conf_dir: str = CONF_DIR) -> dict[str, Any]:
    """{dotted key: value} an option file sets (a block's values from config.yaml when option is None)."""
    if group in BLOCKS:
        tree = OmegaConf.to_container(OmegaConf.load(os.path.join(conf_dir, "config.yaml")))[group]
    else:
        tree = OmegaConf.to_container(OmegaConf.load(os.path.join(conf_dir, group, f"{option}.yaml")))
    return dict(_flat(tree or {}, f"{group}."))


def _flat(tree: dict, prefix: str) -> Iterator[tuple[str, Any]]:
    for k, v in tree.items():
        if isinstance(v, dict) and v and k != "tables":
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def option_doc(group: str, option: str, conf_dir: str = CONF_DIR) -> str:
    """The comment at the top of an option's file, as one line (its pointer to this page left out)."""
    lines = []
    for line in open(os.path.join(conf_dir, group, f"{option}.yaml"), encoding="utf-8"):
        if not line.startswith("#"):
            break
        if "docs/config.md" not in line:
            lines.append(line.lstrip("#").strip())
    return " ".join(x for x in lines if x)


def drifts(conf_dir: str = CONF_DIR) -> list[str]:
    """Where conf/ and the schema disagree, one line per key: a key a YAML file sets that the schema
    lacks, and a value of a group's default option (or of a block of config.yaml) that is not the
    key's schema default. Other options may set other values: that is what an option is."""
    known = {k.name: k for k in keys()}
    out = []
    for group in groups():
        for option in (options(group, conf_dir) or [None]):
            where = "conf/config.yaml" if option is None else f"conf/{group}/{option}.yaml"
            is_default = option is None or option == default_options(conf_dir).get(group)
            for name, value in option_values(group, option, conf_dir).items():
                if name not in known:
                    out.append(f"{name}: set in {where}, not a key of the schema")
                elif is_default and value != known[name].default:
                    out.append(f"{name}: {yaml_value(value)} in {where}, {yaml_value(known[name].default)} "
                               "in the schema (trainer/base/config/schema.py)")
    return out


# ---------------------------------------------------------------- the page
def _cell(text: str) -> str:
    """Text safe in a Markdown table cell: | and * escaped, a <word> not read as an HTML tag."""
    return re.sub(r"<(?=[A-Za-z/])", "&lt;", text.replace("|", "\\|").replace("*", "\\*"))


def _short(v: Any) -> str:
    return f"[{len(v)} values]" if isinstance(v, list) and len(v) > 6 else yaml_value(v)


def _summary(cls: type) -> str:
    return " ".join((cls.__doc__ or "").split())


def render(conf_dir: str = CONF_DIR) -> str:
    """The generated part of docs/config.md (between BEGIN and END, exclusive)."""
    hints = typing.get_type_hints(Config)
    lines = ["## Groups and blocks", "",
             "| group | options (`group=option`; the default first) | what it sets |", "|---|---|---|"]
    for g in groups():
        opts = options(g, conf_dir)
        where = ", ".join(f"`{o}`" for o in opts) if opts else "(a block of `conf/config.yaml`)"
        lines.append(f"| [`{g}`](#{g}) | {where} | {_cell(_summary(hints[g]))} |")
    lines += ["", "## Renamed keys", "",
              "An old name still works for one release: given as an override or in a config file, it is read",
              "as the new key with one warning line (`trainer/base/config/load.py`'s `RENAMED`).", "",
              "| old name | new name |", "|---|---|"]
    lines += [f"| `{old}` | `{new}` |" for old, new in RENAMED.items()]
    lines += ["", "## Key reference", "",
              "Every key with its type, its default (what `python -m trainer` composes from `conf/`, and the",
              "dataclass default in `trainer/base/config/schema.py`) and its doc. `null` where a recipe fills the",
              "key means \"the recipe's\" ([recipe.md](recipe.md) lists each recipe's values). A group's other",
              "options set the values shown in the last column; a key an option leaves out keeps its default.",
              "`<t>` is a table index (`+cache.tables.0.capacity_rows=100`)."]
    for g in groups():
        opts = options(g, conf_dir)
        lines += ["", f"### {g}", "", _cell(_summary(hints[g]))]
        if opts:
            lines.append("")
            for o in opts:
                mark = " (default)" if o == opts[0] else ""
                lines.append(f"- `{g}={o}`{mark}: {_cell(option_doc(g, o, conf_dir))}")
        values = {o: option_values(g, o, conf_dir) for o in opts[1:]}
        lines += ["", "| key | type | default | doc |" + (" other options |" if values else ""),
                  "|---|---|---|---|" + ("---|" if values else "")]
        for k in keys(hints[g], f"{g}."):
            default = "" if k.type == "block" else f"`{yaml_value(k.default)}`"
            row = f"| `{k.name}` | {_cell(k.type)} | {default} | {_cell(k.doc)} |"
            if values:
                other = [f"{o}: `{_short(v[k.name])}`" for o, v in values.items()
                         if k.name in v and v[k.name] != k.default]
                row += f" {', '.join(other)} |"
            lines.append(row)
    return "\n".join(lines)


def page_part(text: str) -> str:
    """The generated part of a page's text (between BEGIN and END); ValueError without markers."""
    try:
        a = text.index(BEGIN) + len(BEGIN)
        return text[a:text.index(END, a)].strip("\n")
    except ValueError:
        raise ValueError(f"no generated part: the page needs the lines {BEGIN!r} and {END!r}") from None


def defaults_in_page(text: str) -> dict[str, str]:
    """{key: its default cell} of the reference tables of a page ("" for a block)."""
    out = {}
    for line in page_part(text).splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) >= 4 and cells[0].startswith("`") and cells[0].endswith("`") and "." in cells[0]:
            out[cells[0].strip("`")] = cells[2].strip("`")
    return out


def page_drifts(text: str, conf_dir: str = CONF_DIR) -> list[str]:
    """Keys the page lacks, has but the schema does not, or gives another default than the schema."""
    page, out = defaults_in_page(text), []
    for k in keys():
        want = "" if k.type == "block" else yaml_value(k.default)
        if k.name not in page:
            out.append(f"{k.name}: missing from the page")
        elif page[k.name] != want:
            out.append(f"{k.name}: default {page[k.name]} on the page, {want} in the schema")
    known = {k.name for k in keys()}
    out += [f"{name}: on the page, not a key of the schema" for name in page if name not in known]
    return out


def write(text: str) -> str:
    """text with its generated part replaced by render()'s."""
    a = text.index(BEGIN) + len(BEGIN)
    return text[:a] + "\n" + render() + "\n" + text[text.index(END, a):]


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.base.config.doc", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", metavar="PAGE", nargs="?", const=PAGE, help=f"compare PAGE (default {PAGE})")
    p.add_argument("--write", metavar="PAGE", nargs="?", const=PAGE, help="rewrite PAGE's generated part")
    a = p.parse_args(argv)
    if a.write:
        old = open(a.write, encoding="utf-8").read()
        new = write(old)
        if new != old:
            open(a.write, "w", encoding="utf-8").write(new)
        print(f"{a.write}: {'rewritten' if new != old else 'up to date'}")
        return 0
    if a.check:
        text = open(a.check, encoding="utf-8").read()
        problems = drifts() + page_drifts(text)
        if not problems and page_part(text) != render():
            problems.append(f"{a.check}: the generated part differs from python -m trainer.base.config.doc's output")
        for line in problems:
            print(line, file=sys.stderr)
        return 1 if problems else 0
    print(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
