"""The docs cite implementation lines as `file` Lnn: `code`; each citation must still be true."""
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REF = re.compile(r"`([\w./]+\.py)` L(\d+): `([^`]+)`")


def test_every_line_reference_in_docs_points_at_its_code():
    refs = 0
    for page in glob.glob(os.path.join(ROOT, "docs", "*.md")):
        text = open(page).read()
        for path, line, code in REF.findall(text):
            lines = open(os.path.join(ROOT, path)).read().splitlines()
            assert int(line) <= len(lines) and code in lines[int(line) - 1], \
                f"{os.path.basename(page)}: {path} L{line} no longer holds `{code}` (run scripts/refresh_doc_refs.py)"
            refs += 1
    assert refs >= 30


def test_every_script_has_a_page_and_the_readme_links_it():
    readme = open(os.path.join(ROOT, "README.md")).read()
    for script in glob.glob(os.path.join(ROOT, "train_*.py")):
        name = os.path.basename(script)[len("train_"):-3]
        assert os.path.exists(os.path.join(ROOT, "docs", f"{name}.md")), name
        assert f"docs/{name}.md" in readme, name
