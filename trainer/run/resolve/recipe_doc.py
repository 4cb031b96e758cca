"""docs/recipe.md's table of recipe values, generated from trainer/run/resolve/recipes.py (its table: ROWS and
MODEL_ROWS), so the page cannot drift from the values a run gets.

    python -m trainer.run.resolve.recipe_doc --write    # rewrite the page's generated part
    python -m trainer.run.resolve.recipe_doc --check    # exit 1 when the page differs
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional

from ...base.config import MODELS
from .recipes import EVAL_PER_EPOCH, MODEL_RECIPE_VALUES, RECIPE_VALUES, recipe_keys

BEGIN = ("<!-- BEGIN generated recipe table: written by python -m trainer.run.resolve.recipe_doc --write from "
         "trainer/run/resolve/recipes.py; edit that, not this part -->")
END = "<!-- END generated recipe table -->"
PAGE = "docs/recipe.md"
ORDER = ("tiny", "small", "large", "none")  # the columns: the smallest data first


def _value(v: Any) -> str:
    if v == EVAL_PER_EPOCH:
        return "per epoch (k times)"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return str(v).replace("'", "")


def _cell(recipe: str, key: str) -> str:
    """The recipe's value of key, then the models whose own value differs ("wdl, dcn: 32"); "(not
    set)" where the recipe leaves the key to the preset or option file."""
    base = RECIPE_VALUES[recipe].get(key)
    by_value: dict[str, list[str]] = {}
    for model in MODELS:
        own = MODEL_RECIPE_VALUES.get(recipe, {}).get(model, {})
        if key in own and own[key] != base:
            by_value.setdefault(_value(own[key]), []).append(model)
    parts = [] if base is None else [f"`{_value(base)}`"]
    parts += [f"{', '.join(models)}: `{v}`" for v, models in by_value.items()]
    return "; ".join(parts) or "(not set)"


def render() -> str:
    keys = list(dict.fromkeys([*recipe_keys(), *(k for m in MODELS for k in recipe_keys(m))]))
    lines = ["| key (left `null` in the presets) | " + " | ".join(ORDER) + " |", "|---|" + "---|" * len(ORDER)]
    lines += [f"| `{k}` | " + " | ".join(_cell(r, k) for r in ORDER) + " |" for k in keys]
    return "\n".join(lines)


def write(text: str) -> str:
    a = text.index(BEGIN) + len(BEGIN)
    return text[:a] + "\n" + render() + "\n" + text[text.index(END, a):]


def page_part(text: str) -> str:
    a = text.index(BEGIN) + len(BEGIN)
    return text[a:text.index(END, a)].strip("\n")


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.run.resolve.recipe_doc", description=__doc__.split("\n\n")[0])
    p.add_argument("--check", metavar="PAGE", nargs="?", const=PAGE, help=f"compare PAGE (default {PAGE})")
    p.add_argument("--write", metavar="PAGE", nargs="?", const=PAGE, help="rewrite PAGE's generated part")
    a = p.parse_args(argv)
    if not (a.check or a.write):
        print(render())
        return 0
    path = a.write or a.check
    if not os.path.isfile(path):
        print(f"error: {path}: no such file (run from the repository root or give the page's path)", file=sys.stderr)
        return 2
    text = open(path).read()
    if BEGIN not in text or END not in text:
        print(f"error: {path}: no generated part (the lines {BEGIN!r} and {END!r})", file=sys.stderr)
        return 2
    if a.write:
        new = write(text)
        if new != text:
            with open(path, "w") as f:
                f.write(new)
        print(f"{path}: {'rewritten' if new != text else 'up to date'}")
        return 0
    if page_part(text) != render():
        print(f"{path}: the recipe table differs from trainer/run/resolve/recipes.py: python -m trainer.run.resolve.recipe_doc --write",
              file=sys.stderr)
        return 1
    print(f"{path}: up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
