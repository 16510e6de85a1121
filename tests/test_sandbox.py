"""The python tool's confinement (rlmini/sandbox.py) against hostile code: every attack of
tests/sandbox_attacks.py fails with the kernel's error, as root and as an unprivileged user, in each mode this
machine offers; the start-up line and the refusal where namespaces or Landlock are missing (simulated by a
seccomp filter, as Docker's profile and an old kernel give them); the run folder's own safety (checkpoints,
scratch leftovers); no import cycle in the project."""
import ast
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

from rlmini import checkpoint, sandbox

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ATTACKS = os.path.join(ROOT, "tests", "sandbox_attacks.py")
SYSTEM_PYTHON = "/usr/bin/python3"
NOBODY = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]


def _as_nobody_problem() -> str:
    """Why the attacks cannot run as an unprivileged user here ('' if they can): they need root to switch, the
    system's Python (the venv may sit under /root) and a repository that user can read."""
    if os.geteuid() != 0 or not shutil.which("setpriv") or not os.path.exists(SYSTEM_PYTHON):
        return "needs root, setpriv and /usr/bin/python3"
    probe = subprocess.run(NOBODY + [SYSTEM_PYTHON, "-c", f"import sys; sys.path.insert(0, {ROOT!r}); "
                                                          "import rlmini.sandbox"], capture_output=True)
    return "" if probe.returncode == 0 else "nobody cannot read this repository or run the system's Python"


@pytest.mark.slow
@pytest.mark.parametrize("user", ["root", "nobody"])
@pytest.mark.parametrize("mode", ["namespaces", "landlock"])
def test_every_attack_fails_with_the_kernels_error(mode, user):
    if user == "nobody" and _as_nobody_problem():
        pytest.skip(_as_nobody_problem())
    if user == "root" and os.geteuid() != 0:
        pytest.skip("not root")
    argv = [sys.executable, ATTACKS, mode] if user == "root" else NOBODY + [SYSTEM_PYTHON, ATTACKS, mode]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "RLMINI_ATTACK_SECRET": "s3cret-token-of-the-trainer"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    if "unavailable" in report:
        pytest.skip(report["unavailable"])
    assert report["uid"] == (0 if user == "root" else 65534)
    assert report["line"].startswith("python tool sandbox: " + ("namespaces" if mode == "namespaces"
                                                                else "Landlock"))
    failed = [r for r in report["results"] if not r["blocked"]]
    assert not failed, "\n".join(f"{r['class']}: {r['attack']}: {r['error']}" for r in failed)
    assert len(report["results"]) >= 30 and {r["class"] for r in report["results"]} >= {
        "read", "write", "process", "signal", "network", "persistence", "resources", "hook"}
    assert all(report["checks"].values()), report["checks"]  # the run went on and nothing outside changed


SIMULATE = """
import errno, sys
sys.path.insert(0, {root!r})
from rlmini import sandbox
sandbox.install_seccomp(sandbox.seccomp_program(None, {deny}))
import common
from rlmini import tools
for mode in ("auto", "namespaces", "landlock", "none"):
    try:
        tools.make_toolbox(common.Args(tools="python", tool_sandbox=mode))
        print(mode, "ok")
    except SystemExit as e:
        print(mode, "refused:", e)
"""


def _simulated(deny: str) -> tuple:
    """(stdout lines, stderr lines) of make_toolbox in each --tool_sandbox mode, in a process whose kernel
    answers the `deny` syscalls with an error (a seccomp filter: what Docker's profile does to unshare)."""
    proc = subprocess.run([sys.executable, "-c", SIMULATE.format(root=ROOT, deny=deny)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.splitlines(), [x for x in proc.stderr.splitlines() if x.startswith("python tool")]


def test_without_namespaces_landlock_holds_and_the_line_says_what_stays_open():
    if not sandbox.landlock_abi() or sandbox.seccomp_missing():
        pytest.skip("this machine has no Landlock (or seccomp) to fall back on")
    out, lines = _simulated('{"unshare": errno.EPERM}')
    assert out[0] == "auto ok" and out[2:] == ["landlock ok", "none ok"]
    assert out[1].startswith("namespaces refused: --tool_sandbox namespaces: this machine cannot create them "
                             "(unshare: Operation not permitted)")
    auto = lines[0]
    assert "Landlock ABI" in auto and "without namespaces (unshare: Operation not permitted)" in auto
    assert "open: " in auto and "scratch folder's total size" in auto, "what stays open is said"
    assert lines[-1].startswith("python tool sandbox: none") and len(lines) == 3
    assert auto.endswith("; a call: 1024 MiB of memory in one process, 5 s")


def test_without_landlock_python_refuses_in_one_line_unless_told_none():
    out, lines = _simulated('{"landlock_create_ruleset": errno.ENOSYS}')
    for line in out[:3]:
        assert line.endswith("refused: --tools python: no kernel isolation for model-written code here "
                             "(Landlock: not in this kernel (or not enabled at boot)); --tool_sandbox none "
                             "runs it under the audit hook alone, which is no boundary"), line
    assert out[3] == "none ok" and lines == [lines[0]] and "audit hook and rlimits only" in lines[0]


def test_a_bad_mode_is_one_line():
    with pytest.raises(SystemExit, match="--tool_sandbox 'docker': choose one of auto, namespaces, landlock, "
                                         "none"):
        sandbox.plan("docker")


def test_a_run_folder_the_tool_may_read_is_refused():
    with pytest.raises(SystemExit, match="lies inside .* which the python tool may read"):
        sandbox.check_run_dir(os.path.join(sandbox.read_paths()[-1], "runs", "x"))


def test_a_killed_runs_scratch_folders_are_removed_when_it_starts_again(tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox, "_PARENTS", {})
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    run_dir = str(tmp_path / "run")
    first = sandbox.scratch_parent(run_dir)
    os.makedirs(os.path.join(first, "call-left", "d"))  # a call of a run that was killed: its folder stays
    os.chmod(os.path.join(first, "call-left"), 0)       # ... made unremovable by its code (mode none)
    dead = tmp_path / "rlmini-tool-pid999999999"         # eval.py's, of a process that is gone
    dead.mkdir()
    (dead / sandbox.SCRATCH_MARKER).touch()
    unmarked = tmp_path / "rlmini-tool-pid999999998"     # not made by us (no marker, a user's file): kept
    unmarked.mkdir()
    (unmarked / "mine.txt").write_text("mine")
    monkeypatch.setattr(sandbox, "_PARENTS", {})         # the run starts again
    assert sandbox.scratch_parent(run_dir) == first and os.listdir(first) == [sandbox.SCRATCH_MARKER]
    assert not dead.exists() and unmarked.exists()
    shutil.rmtree(unmarked)
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(first)]
    taken = first + "-user"
    os.rename(first, taken)
    os.makedirs(first)  # the user's own folder where the run's scratch parent goes
    with open(os.path.join(first, "mine.txt"), "w") as f:
        f.write("mine")
    with pytest.raises(SystemExit, match=r"exists and was not made by rlmini \(no \.rlmini-scratch\): not "
                                         r"removed"):
        sandbox._fresh_parent(f"{os.path.realpath(run_dir)}#0")
    assert open(os.path.join(first, "mine.txt")).read() == "mine"
    shutil.rmtree(first)
    os.makedirs(os.path.join(first, "call-x"))  # a scratch parent from before the marker: calls' folders only
    assert sandbox._fresh_parent(f"{os.path.realpath(run_dir)}#0") == first
    assert os.listdir(first) == [sandbox.SCRATCH_MARKER]
    shutil.rmtree(first)
    os.rename(taken, first)
    assert subprocess.run([sys.executable, "-c", f"import sys, tempfile; sys.path.insert(0, {ROOT!r}); "
                           f"tempfile.tempdir = {str(tmp_path)!r}; from rlmini import sandbox; "
                           f"print(sandbox.scratch_parent({run_dir!r} + '2'))"], capture_output=True,
                          check=True).stdout.strip(), "a process that ends removes its own"
    assert sorted(os.listdir(tmp_path)) == [os.path.basename(first)]


def test_mode_none_is_the_audit_hook_alone():
    from rlmini import tools
    b = tools.Toolbox({"python": tools.python}, sandbox="none")
    fork, ok = tools.run_calls(b, [("python", "import os; os.fork()"), ("python", "6 * 7")])
    assert "PermissionError: os.fork is not allowed in the python tool" in fork.text and ok.text == "42\n"


def test_a_checkpoint_with_code_in_it_is_refused_and_the_code_never_runs(tmp_path):
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    path = tmp_path / "checkpoint.pt"
    state = {"model": {"w": torch.zeros(2)}, "step": 3}
    checkpoint.save_checkpoint(str(path), state)
    loaded = checkpoint.load_checkpoint(str(path))
    assert loaded["step"] == 3 and torch.equal(loaded["model"]["w"], torch.zeros(2))
    with open(path, "wb") as f:  # what a tool (or anyone) writing the run folder would leave
        pickle.dump({"model": Payload()}, f, protocol=2)
    with pytest.raises(SystemExit, match=r"^--resume: .*checkpoint.pt holds more than tensors and plain "
                                         r"values, refused \(weights_only\)"):
        checkpoint.load_checkpoint(str(path))
    assert not marker.exists()


def test_a_sharded_checkpoints_metadata_with_code_in_it_is_refused(tmp_path):
    """torchrun's checkpoint folder: torch.distributed.checkpoint unpickles .metadata as it is; it is read
    first with the globals such a file holds only."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    folder = str(tmp_path / "checkpoint")
    dcp.save({"policy": dict(zip(("model", "optimizer"), get_state_dict(model, optimizer)))},
             checkpoint_id=folder)
    checkpoint.check_sharded_metadata(folder)  # a folder the trainer wrote passes
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    with open(os.path.join(folder, ".metadata"), "wb") as f:
        pickle.dump(Payload(), f, protocol=2)
    with pytest.raises(SystemExit, match=r"^--resume: .*\.metadata holds more than a checkpoint's metadata, "
                                         r"refused: .*open is not"):
        checkpoint.check_sharded_metadata(folder)
    assert not marker.exists()


def _project_imports() -> dict:
    """module -> the project modules it imports anywhere in its code (functions included)."""
    files = {os.path.splitext(f)[0]: os.path.join(ROOT, f) for f in os.listdir(ROOT) if f.endswith(".py")}
    package = os.path.join(ROOT, "rlmini")
    files.update({f"rlmini.{os.path.splitext(f)[0]}": os.path.join(package, f) for f in os.listdir(package)
                  if f.endswith(".py") and f != "__init__.py"})
    graph = {}
    for name, path in files.items():
        found = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = sorted(found & set(files) - {name})
    return graph


def test_the_project_has_no_import_cycle():
    graph, state, cycles = _project_imports(), {}, []

    def visit(m, path):
        state[m] = "open"
        for n in graph[m]:
            if state.get(n) == "open":
                cycles.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = "done"

    for m in graph:
        if m not in state:
            visit(m, [m])
    assert not cycles, " ; ".join(" -> ".join(c) for c in cycles)
    assert "rlmini.tools" not in graph["rewards"] and "rlmini.tools" not in graph["rlmini.data"]
