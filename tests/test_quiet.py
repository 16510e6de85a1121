"""The terminal holds the trainer's own lines; what the libraries print (logging, warnings, C++ notices on the
file descriptors, subprocesses) goes to the run folder's logs/rank<R>.log, or stays on the terminal with
--verbose true (rlmini/quiet.py). A quiet vLLM run, and one that stops in one line: tests/test_engine_life.py.
"""
import io
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, VLLM_INFO, not_ours

# an entry point (faults.user_errors) whose "libraries" write every way they do, before the run folder
# exists and after; then it stops, as bad input (one line) or as our bug (a traceback)
ENTRY = """
import logging, os, subprocess, sys, warnings
from types import SimpleNamespace
sys.path.insert(0, {root!r})
from rlmini import faults, quiet
from rlmini.task import DataError
with faults.user_errors():
    quiet.start(SimpleNamespace(verbose=False))
    os.write(2, b"a C++ notice on descriptor 2\\n")
    warnings.warn("a library's FutureWarning", FutureWarning)
    print("start-up: model 1.0 s (ours)")
    quiet.to_run_dir({run_dir!r}, resume=False)
    logging.getLogger("a_library").warning("a library's logging")
    subprocess.run(["echo", "a subprocess's line"], check=True)
    print("warning: ours, on stderr", file=sys.stderr)
    raise {error}("what went wrong")
"""
LIBRARY = ["a C++ notice on descriptor 2", "FutureWarning: a library's FutureWarning", "a library's logging",
           "a subprocess's line"]


@pytest.mark.parametrize("error", ["DataError", "RuntimeError"])
def test_the_libraries_go_to_the_run_log_and_errors_to_the_terminal(tmp_path, error):
    proc = _entry(tmp_path, error)
    assert proc.stdout == "start-up: model 1.0 s (ours)\n"
    if error == "DataError":  # bad input: one line, after the terminal was restored
        assert proc.returncode == 2 and proc.stderr == "warning: ours, on stderr\nerror: what went wrong\n"
    else:  # our bug: a traceback
        assert proc.returncode == 1 and proc.stderr.startswith("warning: ours, on stderr\nTraceback")
        assert proc.stderr.endswith("RuntimeError: what went wrong\n")
    log = open(tmp_path / "run" / "logs" / "rank0.log").read()
    assert all(line in log for line in LIBRARY), log  # what came before the run folder existed too


@pytest.mark.slow
def test_verbose_shows_vllms_output_on_the_terminal(tmp_path):
    """The same run quiet (tests/test_engine_life.py) prints only its own lines."""
    argv = ["--out_dir", str(tmp_path), "--wandb", "false", "--steps", "1", "--prompts_per_step", "2",
            "--group_size", "2", "--save_every", "-1", "--verbose", "true"]
    proc = subprocess.run([sys.executable, "train_grpo.py", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert any(VLLM_INFO.search(line) for line in not_ours(proc.stdout, proc.stderr)), proc.stdout[-3000:]
    assert not os.path.exists(tmp_path / "grpo-addition-tiny-s0" / "logs")


def _entry(tmp_path, error: str) -> subprocess.CompletedProcess:
    os.makedirs(tmp_path / "run")
    code = ENTRY.format(root=ROOT, run_dir=str(tmp_path / "run"), error=error)
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_on_a_terminal_the_start_up_says_what_it_is_doing(tmp_path, monkeypatch):
    """On a terminal each start-up phase is announced as it begins, on a line ending in a carriage return that
    the phase's own line (longer) overwrites; without one (every other test's output) nothing is added."""
    import train_grpo
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    train_grpo.main(["--out_dir", str(tmp_path), "--wandb", "false", "--engine", "hf", "--steps", "1",
                     "--prompts_per_step", "2", "--group_size", "2", "--save_every", "-1"])
    out = terminal.getvalue()
    shown = re.findall(r"start-up: ([^\r\n]*?) \.\.\.\r", out)
    assert shown == ["task and model (tiny)", "starting the hf engine", "first step: rollout",
                     "first step: update", "first step: push"], out
    for line in out.split("\n"):  # on a terminal the last text after a carriage return covers the rest
        *over, last = line.split("\r")
        assert all(len(last) >= len(text) for text in over), line
