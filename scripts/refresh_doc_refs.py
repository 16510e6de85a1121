"""Re-point the docs' `file` Lnn: `code` references at the line where the quoted code now stands
(the nearest occurrence to the old number). Run after editing a train_*.py; tests/test_docs.py
fails while a reference is stale.

    python scripts/refresh_doc_refs.py
"""
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REF = re.compile(r"`([\w./]+\.py)` L(\d+): `([^`]+)`")


def refresh(page: str) -> int:
    text = open(page).read()
    changed = 0

    def fix(m):
        nonlocal changed
        path, line, code = m.group(1), int(m.group(2)), m.group(3)
        lines = open(os.path.join(ROOT, path)).read().splitlines()
        hits = [i + 1 for i, s in enumerate(lines) if code in s]
        if not hits:
            raise SystemExit(f"{os.path.basename(page)}: `{code}` is no longer in {path}: edit the page")
        new = min(hits, key=lambda i: abs(i - line))
        changed += new != line
        return f"`{path}` L{new}: `{code}`"

    out = REF.sub(fix, text)
    if out != text:
        open(page, "w").write(out)
    return changed


if __name__ == "__main__":
    for page in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        n = refresh(page)
        if n:
            print(f"{os.path.relpath(page, ROOT)}: {n} reference(s) moved")
