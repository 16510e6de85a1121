"""docs/options.md from the scripts' Args: every option with its default, its valid values and its help.

    python scripts/options_table.py            # rewrite docs/options.md
    python scripts/options_table.py --check    # exit 1 if docs/options.md is not what the Args say
"""
import dataclasses
import importlib
import os
import sys
import typing
from typing import Literal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SCRIPTS = ["train_grpo", "train_rloo", "train_corpo", "train_gpg", "train_ppo"]
PAGE = os.path.join(ROOT, "docs", "options.md")


def values(f) -> str:
    """The option's valid values: its choices, its range, or its type."""
    from rlmini.options import range_text
    if typing.get_origin(f.type) is Literal:
        return " \\| ".join(f"`{c}`" for c in typing.get_args(f.type))
    bounds = f.metadata.get("range", (None,) * 4)
    kind = next((t for t in typing.get_args(f.type) if t is not type(None)), f.type)
    text = kind.__name__ if isinstance(kind, type) else str(kind)
    return f"{text} {range_text(*bounds)}" if any(b is not None for b in bounds) else text


def table(fields) -> list:
    rows = ["| flag | default | values | meaning |", "|---|---|---|---|"]
    for f in fields:
        shown = str(f.default).lower() if isinstance(f.default, bool) else f.default
        default = "" if f.default in ("", None) else f"`{shown}`"
        meaning = f.metadata["help"].replace("|", "\\|")  # a table cell
        rows.append(f"| `--{f.name}` | {default} | {values(f)} | {meaning} |")
    return rows


def page() -> str:
    import common
    shared = {f.name for f in dataclasses.fields(common.Args)}
    out = ["# Options", "",
           "Generated from the scripts' `Args` by `python scripts/options_table.py` (a test checks that it "
           "is current).",
           "Every option is a flag (`--name value`; a bare boolean flag means true) or a key of a `--config` "
           "YAML/JSON file;",
           "a flag given on the command line overrides the file.", "",
           "## Every script", "", *table(dataclasses.fields(common.Args))]
    for name in SCRIPTS:
        own = [f for f in dataclasses.fields(importlib.import_module(name).Args) if f.name not in shared]
        out += ["", f"## `{name}.py`", "", *table(own)]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    text = page()
    if "--check" in sys.argv:
        same = os.path.exists(PAGE) and open(PAGE).read() == text
        print("docs/options.md is "
              "current" if same else "docs/options.md is stale: python scripts/options_table.py")
        sys.exit(0 if same else 1)
    with open(PAGE, "w") as f:
        f.write(text)
    print(f"wrote {PAGE}")
