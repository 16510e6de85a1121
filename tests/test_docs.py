"""The docs stay true: every `file.py::name` citation names a definition that holds the quoted code, every
relative link resolves, docs/options.md is what the scripts' Args say, the README's file map counts the lines
the files have, and every Python line fits in 110 columns. Every fenced code block of docs/algorithms.md and
docs/loop.md is a worked example's, built from the blocks' own lines and trained (tests/test_siblings.py); a
line of the real loop is quoted inline as a citation instead, so a block of any other kind fails here."""
import ast
import dataclasses
import difflib
import functools
import glob
import importlib
import inspect
import os
import re
import subprocess
import sys

import pytest

import common
import test_siblings
from conftest import ROOT, code_blocks, docs_page, no_page, undocumented
from test_siblings import EXAMPLES, worked_example

CITE = re.compile(r"`([\w./]+\.py)::([\w.]+)`(?:: `([^`]+)`)?")
PAGES = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) + [os.path.join(ROOT, "README.md")]


@functools.lru_cache(maxsize=None)  # a file cited many times is parsed once (was 20 s of the suite)
def definitions(path: str) -> dict:
    """{name or Class.name: source} of every function and class in a file."""
    text = open(os.path.join(ROOT, path)).read()
    out = {}
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out[node.name] = ast.get_source_segment(text, node)
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    out[f"{node.name}.{item.name}"] = ast.get_source_segment(text, item)
    return out


@pytest.mark.slow
def test_every_citation_names_a_definition_that_holds_the_quoted_code():
    cited = 0
    for page in PAGES:
        for path, name, code in CITE.findall(open(page).read()):
            where = f"{os.path.relpath(page, ROOT)}: `{path}::{name}`"
            assert os.path.exists(os.path.join(ROOT, path)), f"{where}: no such file"
            found = definitions(path)
            assert name in found, f"{where}: {path} defines no {name}"
            assert not code or code in found[name], f"{where} no longer holds `{code}`"
            cited += 1
    assert cited >= 60


def test_every_relative_link_resolves():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", open(page).read()):
            if not target.startswith(("http://", "https://")):
                path = os.path.normpath(os.path.join(os.path.dirname(page), target))
                assert os.path.exists(path), f"{os.path.relpath(page, ROOT)}: link to {target}"


def page_problems(script: str) -> list:
    """What a train_*.py lacks, one line each: its page (Args.docs_page, default docs/<name>.md), the
    README's link to it."""
    page = docs_page(script)
    if not os.path.exists(os.path.join(ROOT, page)):
        return [no_page(script, page)]
    if f"({page})" not in open(os.path.join(ROOT, "README.md")).read():
        return [f"{script}.py: README.md does not link {page}; add a row to its table of algorithms"]
    return []


def test_every_script_has_a_page_and_the_readme_links_it():
    problems = [p for path in glob.glob(os.path.join(ROOT, "train_*.py"))
                for p in page_problems(os.path.basename(path)[:-3])]
    assert not problems, "\n".join(problems)


def test_the_options_page_is_generated_from_the_args():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "options_table.py"), "--check"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_options_page_gives_each_scripts_own_group_size_range():
    """The page's --group_size row names, per script, the least group it takes: that group is accepted and
    one less is refused (GRPO's baseline needs two completions, PPO's critic one)."""
    row = next(x for x in open(os.path.join(ROOT, "docs", "options.md")) if x.startswith("| `--group_size`"))
    ranges = re.findall(r"int >= (\d) \(([\w., ]+)\)", row)
    assert sorted(s for _, names in ranges for s in names.split(", ")) == sorted(
        os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "train_*.py"))), row
    for low, names in ranges:
        for name in names.split(", "):
            script = importlib.import_module(name[:-3])
            assert common.parse_args(script.Args, ["--group_size", low]).group_size == int(low)
            with pytest.raises(SystemExit, match=f"--group_size {int(low) - 1}: must be >= {low}"):
                common.parse_args(script.Args, ["--group_size", str(int(low) - 1)])


def test_help_begins_with_what_a_first_run_sets_then_the_algorithms_own(capsys):
    """--help: a one-line usage, then the options a first run sets (model, task, steps, batch, lr), then the
    script's own (its algorithm's), then each group of shared options under its heading; each option once."""
    import train_grpo
    with pytest.raises(SystemExit, match="^0$"):
        common.parse_args(train_grpo.Args, ["--help"])
    text = capsys.readouterr().out
    flags = re.findall(r"^  (--\w+)", text, re.M)
    assert flags[:6] == ["--model", "--task", "--steps", "--prompts_per_step", "--group_size", "--lr"], flags
    assert sorted(flags) == sorted(f"--{f.name}" for f in dataclasses.fields(train_grpo.Args))
    headings = re.findall(r"^(\S[^\n]*):$", text, re.M)
    assert headings[:3] == ["options", "a first run", "train_grpo.py's own"], headings
    assert flags.index("--std_norm") < flags.index("--warmup") < flags.index("--judge_url"), flags
    assert text.startswith("usage: ") and text.index("--model MODEL") < 400


def test_a_new_scripts_options_and_page_are_found_and_checked(tmp_path, monkeypatch):
    """scripts/options_table.py finds every train_*.py by itself; a new script whose options the page lacks
    fails --check, which names it; one without a page is told where to add it, or to declare it."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("options_table", os.path.join(ROOT, "scripts",
                                                                                "options_table.py"))
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    found = glob.glob(os.path.join(ROOT, "train_*.py"))
    assert table.scripts() == sorted(os.path.basename(p)[:-3] for p in found) and len(found) >= 5
    (tmp_path / "train_remax.py").write_text(
        "from dataclasses import dataclass\n\nimport train_rloo\nfrom common import arg\n\n\n@dataclass\n"
        "class Args(train_rloo.Args):\n    baseline_n: int = arg(1, 'greedy completions per prompt', ge=1)\n")
    (tmp_path / "train_vine.py").write_text("from train_rloo import Args  # noqa: F401\n")  # a second one
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("train_remax", "train_vine"):
        monkeypatch.delitem(sys.modules, name, raising=False)  # another test's module of that name
    assert table.scripts(str(tmp_path)) == ["train_remax", "train_vine"]
    text = table.page(table.scripts() + table.scripts(str(tmp_path)))
    assert "## `train_remax.py`" in text and "| `--baseline_n` | `1` | int >= 1 | greedy completions" in text
    ok, why = table.check(open(table.PAGE).read(), text)  # whether the page is current: the test above
    missing = re.match(r"docs/options.md is stale \(no section for ([\w., ]+)\): python scripts/", why)
    assert not ok and missing and {"train_remax.py", "train_vine.py"} <= set(missing.group(1).split(", "))
    for name in ("train_remax", "train_vine"):
        assert page_problems(name) == [f"{name}.py: no docs page docs/{name[6:]}.md; add it, or set "
                                       f"Args.docs_page in {name}.py"]
    with pytest.raises(AssertionError, match=r"^train_vine.py: no docs page docs/vine.md; add it, or set "
                                             r"Args.docs_page in train_vine.py$"):
        undocumented({"reward/mean"}, "vine")  # what the step test meets first for a script without a page
    (tmp_path / "train_remax.py").write_text("from typing import ClassVar\n" + (tmp_path / "train_remax.py")
                                             .read_text() + "    docs_page: ClassVar[str] = 'docs/rloo.md'\n")
    monkeypatch.delitem(sys.modules, "train_remax")
    assert page_problems("train_remax") == []  # the declared page, which the README links


def test_the_readme_file_map_counts_the_lines():
    def lines(path):
        whole = os.path.join(ROOT, path)
        files = glob.glob(os.path.join(whole, "*.py")) if path.endswith("/") else [whole]
        return sum(len(open(f).read().splitlines()) for f in files)
    rows = re.findall(r"^\| (`[^|]+`) \| ([\d,/ ]+) \|", open(os.path.join(ROOT, "README.md")).read(), re.M)
    assert len(rows) >= 6
    for names, counts in rows:
        names, counts = re.findall(r"`([^`]+)`", names), [int(c.replace(",", "")) for c in counts.split("/")]
        assert [lines(n) for n in names] == counts, (names, counts)


def test_every_python_line_fits_in_110_columns():
    long = []
    for path in glob.glob(os.path.join(ROOT, "**", "*.py"), recursive=True):
        for number, line in enumerate(open(path).read().splitlines(), 1):
            if len(line) > 110:
                long.append(f"{os.path.relpath(path, ROOT)}:{number} ({len(line)})")
    assert not long, f"{len(long)} lines over 110 columns: {long[:10]}"


def test_every_code_block_of_the_loop_pages_is_a_worked_example_built_from_its_lines_and_trained():
    """Each block follows a `cp train_X.py train_Y.py` whose train_Y.py tests/test_siblings.py::worked_example
    builds from the blocks' lines (each placed, each hunk between `...` lines contiguous in the script) and a
    test there trains; each compiles, every `common.X` it calls exists (fast, before the training runs), and
    the `diff` size the page states is the built script's."""
    trained = inspect.getsource(test_siblings)
    for block in (b for page in ("docs/algorithms.md", "docs/loop.md") for b in code_blocks(page)):
        name = block.copy[1][len("train_"):-len(".py")] if block.copy else None
        assert name in EXAMPLES and f'worked_example("{name}", tmp_path)' in trained, \
            f"{block.page}:{block.line}: a ```{block.lang} block that no test builds and runs: quote the " \
            "loop's lines inline (`file.py::function`: `line`, checked above), or make it a worked example " \
            "(EXAMPLES in tests/test_siblings.py) that a test there trains"
    built = {name: worked_example(name) for name in EXAMPLES}
    for name, text in built.items():
        calls = {n.attr for n in ast.walk(ast.parse(text, f"train_{name}.py"))
                 if isinstance(n, ast.Attribute) and getattr(n.value, "id", "") == "common"}
        assert calls <= set(dir(common)), f"train_{name}.py calls common.{calls - set(dir(common))}"
    size = r"`diff (train_\w+\.py)\s+train_(\w+)\.py` is (\d+) lines \((\d+) removed, (\d+) added\)"
    stated = re.findall(size, open(os.path.join(ROOT, "docs", "algorithms.md")).read())
    assert sorted(name for _, name, *_ in stated) == sorted(EXAMPLES)  # a stale context line adds a line
    for source, name, *counts in stated:
        diff = list(difflib.unified_diff(open(os.path.join(ROOT, source)).read().splitlines(),
                                         built[name].splitlines(), n=0))[2:]
        removed, added = (sum(line.startswith(c) for line in diff) for c in "-+")
        assert [int(c) for c in counts] == [removed + added, removed, added], (name, removed, added)


def changed_lines(a: str, b: str) -> int:
    """`diff a b | grep -c '^[<>]'`, the command the docs give (difflib pairs some lines otherwise)."""
    out = subprocess.run(["diff", a, b], cwd=ROOT, capture_output=True, text=True).stdout
    return sum(line.startswith(("<", ">")) for line in out.splitlines())


def test_the_sibling_diff_counts_the_docs_state_are_current():
    """docs/algorithms.md's `RLOO N, CoRPO N, GPG N (its loss), PPO N` and each page's `diff train_grpo.py
    train_X.py` (N changed lines) are what diff counts today."""
    text = open(os.path.join(ROOT, "docs", "algorithms.md")).read()
    stated = re.search(r"RLOO (\d+), CoRPO (\d+), GPG (\d+) \(its loss\), PPO (\d+)", text)
    assert stated, "docs/algorithms.md: the form `RLOO N, CoRPO N, GPG N (its loss), PPO N` is gone"
    measured = [changed_lines("train_grpo.py", f"train_{x}.py") for x in ("rloo", "corpo", "gpg", "ppo")]
    assert [int(n) for n in stated.groups()] == measured, f"docs/algorithms.md: diff counts {measured}"
    for name in ("rloo", "corpo", "gpg", "ppo"):
        page = open(os.path.join(ROOT, "docs", f"{name}.md")).read()
        found = re.search(rf"`diff train_grpo.py train_{name}.py`[^.]*?\(?(\d+) changed lines", page, re.S)
        assert found, f"docs/{name}.md: no `diff train_grpo.py train_{name}.py` (N changed lines)"
        assert int(found.group(1)) == changed_lines("train_grpo.py", f"train_{name}.py"), \
            f"docs/{name}.md: {found.group(1)} changed lines, diff counts " \
            f"{changed_lines('train_grpo.py', f'train_{name}.py')}"



def test_every_test_file_keeps_a_test_in_the_fast_tier():
    """`make test-fast` (-m "not slow") runs at least one test of every tests/test_*.py: no file is marked
    slow as a whole, and each has a test without @pytest.mark.slow; the marker is registered (conftest.py)."""
    def slow(node):
        return any("mark.slow" in ast.unparse(d) for d in node.decorator_list)
    for path in sorted(glob.glob(os.path.join(ROOT, "tests", "test_*.py"))):
        tree, name = ast.parse(open(path).read()), os.path.relpath(path, ROOT)
        whole = [ast.unparse(n) for n in tree.body if isinstance(n, ast.Assign)]
        assert not any("pytestmark" in a and "slow" in a for a in whole), f"{name}: marked slow as a whole"
        tests = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]
        assert any(not slow(n) for n in tests), f"{name}: every test is marked slow; keep one fast"
    conftest = open(os.path.join(ROOT, "tests", "conftest.py")).read()
    assert 'addinivalue_line("markers", "slow:' in conftest
