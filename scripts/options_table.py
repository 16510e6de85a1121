"""docs/options.md from the scripts' Args: every option with its default, its valid values and its help.

    python scripts/options_table.py            # rewrite docs/options.md
    python scripts/options_table.py --check    # exit 1 if docs/options.md is not what the Args say

Every train_*.py of the repository is found by itself: a new script's options appear once the page is
rewritten, and until then --check fails, naming the script.
"""
import dataclasses
import glob
import importlib
import inspect
import os
import re
import sys
import typing
from typing import Literal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PAGE = os.path.join(ROOT, "docs", "options.md")


def scripts(root: str = ROOT) -> list:
    """The train_*.py of the repository, by name (module names, sorted)."""
    return sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(root, "train_*.py")))


def values(f) -> str:
    """The option's valid values: its choices, its range, or its type."""
    from rlmini.options import range_text
    if typing.get_origin(f.type) is Literal:
        return " \\| ".join(f"`{c}`" for c in typing.get_args(f.type))
    bounds = f.metadata.get("range", (None,) * 4)
    kind = next((t for t in typing.get_args(f.type) if t is not type(None)), f.type)
    text = kind.__name__ if isinstance(kind, type) else str(kind)
    return f"{text} {range_text(*bounds)}" if any(b is not None for b in bounds) else text


def shared_fields() -> list:
    """common.Args's options: its own first, then its bases' (task, tools, server, plan)."""
    import common
    own = inspect.get_annotations(common.Args)
    fields = dataclasses.fields(common.Args)
    return [f for f in fields if f.name in own] + [f for f in fields if f.name not in own]


def group_size_values(names) -> str:
    """--group_size's range per script: a script with a group baseline raises it (Args.min_group_size)."""
    by_min = {}
    for name in names:
        by_min.setdefault(importlib.import_module(name).Args.min_group_size, []).append(f"{name}.py")
    return "; ".join(f"int >= {low} ({', '.join(s)})" for low, s in sorted(by_min.items(), reverse=True))


def table(fields, names=()) -> list:
    rows = ["| flag | default | values | meaning |", "|---|---|---|---|"]
    for f in fields:
        shown = str(f.default).lower() if isinstance(f.default, bool) else f.default
        default = "" if f.default in ("", None) else f"`{shown}`"
        meaning = f.metadata["help"].replace("|", "\\|")  # a table cell
        valid = group_size_values(names) if f.name == "group_size" and names else values(f)
        rows.append(f"| `--{f.name}` | {default} | {valid} | {meaning} |")
    return rows


def page(names=None) -> str:
    """docs/options.md for the scripts `names` (default: every train_*.py)."""
    import common
    shared = {f.name for f in dataclasses.fields(common.Args)}
    names = scripts() if names is None else names
    out = ["# Options", "",
           "Generated from the scripts' `Args` by `python scripts/options_table.py` (a test checks that it "
           "is current).",
           "Every option is a flag (`--name value`; a bare boolean flag means true) or a key of a `--config` "
           "YAML/JSON file;",
           "a flag given on the command line overrides the file.", "",
           "## Every script", "", *table(shared_fields(), names)]
    for name in names:
        own = [f for f in dataclasses.fields(importlib.import_module(name).Args) if f.name not in shared]
        out += ["", f"## `{name}.py`", "", *table(own)]
    return "\n".join(out) + "\n"


def check(current: str, expected: str) -> tuple[bool, str]:
    """(is the page `current` what the Args say, the line --check prints), naming a script without a
    section."""
    if current == expected:
        return True, "docs/options.md is current"
    missing = [s for s in re.findall(r"^## `(train_\w+\.py)`$", expected, re.M) if f"## `{s}`" not in current]
    why = f" (no section for {', '.join(missing)})" if missing else ""
    return False, f"docs/options.md is stale{why}: python scripts/options_table.py"


if __name__ == "__main__":
    text = page()
    if "--check" in sys.argv:
        same, line = check(open(PAGE).read() if os.path.exists(PAGE) else "", text)
        print(line)
        sys.exit(0 if same else 1)
    with open(PAGE, "w") as f:
        f.write(text)
    print(f"wrote {PAGE}")
