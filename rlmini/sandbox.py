"""Kernel-enforced isolation for the python tool: each call is a fresh interpreter that, before it runs the
model's code, enters the strongest confinement the machine offers (chosen once per process, `plan`):

  namespaces  its own user, PID, network, mount, IPC and UTS namespaces (a PID namespace ends with its first
              process; a network namespace with no interface up; the scratch folder a size-limited tmpfs that
              exists only in the call's mount namespace), plus everything `landlock` does
  landlock    Landlock (reads of the system and Python folders only, writes to the scratch folder only, no
              execution, no TCP bind/connect, no signals or abstract sockets outside the call), seccomp (no
              new process or thread, no socket but TCP/UDP inside an empty network namespace, no
              chmod/chown/xattr/utime, no mount/unshare/ptrace/bpf/io_uring/keyctl/memfd/SysV IPC), every
              capability dropped, no_new_privs, rlimits (address space, CPU, file size, processes, files)
  none        the audit hook and rlimits alone (a guard against accidents, not a boundary)

Everything here but `main` runs in the trainer; `main` runs in the call's own interpreter (`command`), and
uses the standard library and ctypes only. The trainer's functions import their other modules themselves:
a call's interpreter imports only what confining needs (every import is milliseconds of every call).
Kernel ABI sources: include/uapi/linux/landlock.h, include/uapi/linux/seccomp.h, include/uapi/linux/filter.h,
include/uapi/linux/capability.h, arch/x86/entry/syscalls/syscall_64.tbl and include/uapi/asm-generic/unistd.h
(aarch64)."""
import ast
import atexit
import ctypes
import errno
import math
import os
import resource
import signal
import stat
import struct
import sys
import threading
import time

MODES = ("auto", "namespaces", "landlock", "none")
SCRATCH_MB = 64        # the scratch tmpfs (namespaces) and the file-size limit (every mode), MiB
SCRATCH_INODES = 4096  # files and folders the scratch tmpfs holds
OPEN_FILES = 256       # RLIMIT_NOFILE of a call
SETUP_FAILED = 97      # a call's exit status when its confinement could not be set up
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ------------------------------------------------------------------------------------- kernel constants

CLONE_NEWNS, CLONE_NEWCGROUP, CLONE_NEWUTS = 0x00020000, 0x02000000, 0x04000000
CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x08000000, 0x10000000, 0x20000000, 0x40000000
MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 2, 4, 0x4000, 1 << 18
PR_SET_PDEATHSIG, PR_GET_SECCOMP, PR_SET_SECCOMP, PR_CAPBSET_DROP = 1, 21, 22, 24
PR_SET_SECUREBITS, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 28, 38, 47, 4
# SECBIT_NOROOT | _LOCKED | NO_SETUID_FIXUP | _LOCKED | KEEP_CAPS_LOCKED | NO_CAP_AMBIENT_RAISE | _LOCKED
SECUREBITS = 0xEF
CAPABILITY_V3 = 0x20080522  # include/uapi/linux/capability.h

# include/uapi/linux/landlock.h (the syscalls are 444-446 on x86_64 and aarch64 alike)
LANDLOCK_CREATE_RULESET, LANDLOCK_ADD_RULE, LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION, LANDLOCK_RULE_PATH_BENEATH = 1, 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15  # ABI 2, 3, 5
FS_ABI1 = (1 << 13) - 1  # execute .. make_sym: every right of ABI 1
NET_BIND_TCP, NET_CONNECT_TCP = 1, 2  # ABI 4
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1, 2  # ABI 6

# seccomp: include/uapi/linux/seccomp.h, filter.h; struct seccomp_data {int nr; u32 arch; u64 ip; u64 args[6]}
RET_KILL_PROCESS, RET_ERRNO, RET_ALLOW = 0x80000000, 0x00050000, 0x7FFF0000
LD_W_ABS, JEQ_K, JGE_K, RET_K = 0x20, 0x15, 0x35, 0x06
AF_INET, AF_INET6 = 2, 10
X32_BIT = 0x40000000
# the syscalls a call may not make (EPERM), per architecture: (audit arch, {name: number})
_DENIED = ("clone", "clone3", "fork", "vfork", "unshare", "setns", "mount", "umount2", "pivot_root", "chroot",
           "open_tree", "move_mount", "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr", "ptrace",
           "process_vm_readv", "process_vm_writev", "bpf", "perf_event_open", "userfaultfd", "keyctl",
           "add_key", "request_key", "io_uring_setup", "io_uring_enter", "io_uring_register", "memfd_create",
           "shmget", "msgget", "semget", "chmod", "fchmod", "fchmodat", "fchmodat2", "chown", "fchown",
           "lchown", "fchownat", "setxattr", "lsetxattr", "fsetxattr", "removexattr", "lremovexattr",
           "fremovexattr", "setxattrat", "removexattrat", "utime", "utimes", "futimesat", "utimensat")
SYSCALLS = {
    # arch/x86/entry/syscalls/syscall_64.tbl
    "x86_64": (0xC000003E, dict(
        socket=41, clone=56, clone3=435, fork=57, vfork=58, unshare=272, setns=308, mount=165, umount2=166,
        pivot_root=155, chroot=161, open_tree=428, move_mount=429, fsopen=430, fsconfig=431, fsmount=432,
        fspick=433, mount_setattr=442, ptrace=101, process_vm_readv=310, process_vm_writev=311, bpf=321,
        perf_event_open=298, userfaultfd=323, keyctl=250, add_key=248, request_key=249, io_uring_setup=425,
        io_uring_enter=426, io_uring_register=427, memfd_create=319, shmget=29, msgget=68, semget=64,
        chmod=90, fchmod=91, fchmodat=268, fchmodat2=452, chown=92, fchown=93, lchown=94, fchownat=260,
        setxattr=188, lsetxattr=189, fsetxattr=190, removexattr=197, lremovexattr=198, fremovexattr=199,
        setxattrat=463, removexattrat=466, utime=132, utimes=235, futimesat=261, utimensat=280,
        landlock_create_ruleset=444, landlock_add_rule=445, landlock_restrict_self=446)),
    # include/uapi/asm-generic/unistd.h (no fork, vfork, chmod, chown, lchown, utime(s), futimesat)
    "aarch64": (0xC00000B7, dict(
        socket=198, clone=220, clone3=435, unshare=97, setns=268, mount=40, umount2=39, pivot_root=41,
        chroot=51, open_tree=428, move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433,
        mount_setattr=442, ptrace=117, process_vm_readv=270, process_vm_writev=271, bpf=280,
        perf_event_open=241, userfaultfd=282, keyctl=219, add_key=217, request_key=218, io_uring_setup=425,
        io_uring_enter=426, io_uring_register=427, memfd_create=279, shmget=194, msgget=186, semget=190,
        fchmod=52, fchmodat=53, fchmodat2=452, fchown=55, fchownat=54, setxattr=5, lsetxattr=6,
        fsetxattr=7, removexattr=14, lremovexattr=15, fremovexattr=16, setxattrat=463, removexattrat=466,
        utimensat=88, landlock_create_ruleset=444, landlock_add_rule=445, landlock_restrict_self=446)),
}

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class SetupError(OSError):
    """A step of the confinement failed: `main` reports it in one line and exits SETUP_FAILED."""


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise SetupError(err, f"{what}: {os.strerror(err)}")
    return result


def _prctl(option: int, *args) -> int:
    return _libc.prctl(ctypes.c_int(option), *(ctypes.c_ulong(a) for a in args + (0,) * (4 - len(args))))


# ------------------------------------------------------------------------------------- the trainer's side


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; 0 where there is none (not built, or not enabled at boot)."""
    return max(int(_libc.syscall(ctypes.c_long(LANDLOCK_CREATE_RULESET), None, ctypes.c_size_t(0),
                                 ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))), 0)


def seccomp_missing() -> str:
    """Why a seccomp filter cannot be installed here ('' if it can)."""
    if os.uname().machine not in SYSCALLS:
        return f"no syscall table for {os.uname().machine} in rlmini/sandbox.py"
    if _prctl(PR_GET_SECCOMP) < 0:
        return f"seccomp: {os.strerror(ctypes.get_errno())}"
    return ""


def read_paths() -> list:
    """What a call may read: the system's library folders and the Python install (its prefixes, standard
    library and site-packages), outermost folders only; plus the files the C library and time zone need."""
    if _READ:
        return _READ
    import sysconfig
    found = ["/usr", "/lib", "/lib64", "/lib32", "/etc/ld.so.cache", "/etc/localtime"]
    found += [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    # the install's own folders, never sys.path (its first entry is the script's folder: the project's)
    found += [sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")]
    real = sorted({os.path.realpath(p) for p in found if os.path.exists(p)})
    _READ.extend(p for p in real if not any(p != q and _inside(p, q) for q in real))
    return _READ


_READ = []


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


_PLANS, _PARENTS, _LOCK = {}, {}, threading.RLock()


def plan(requested: str = "auto") -> dict:
    """The confinement of this process's python calls for --tool_sandbox `requested` (probed once per mode):
    {"mode", "abi", "line"} where line is the one start-up line saying what is used and what stays open.
    Raises SystemExit (one line) where the mode asked for, or any kernel mode for auto, is not available."""
    if requested not in MODES:
        raise SystemExit(f"--tool_sandbox {requested!r}: choose one of {', '.join(MODES)}")
    with _LOCK:  # calls start in several threads at once: one probe
        if requested not in _PLANS:
            _PLANS[requested] = _plan(requested)
        return _PLANS[requested]


def _plan(requested: str) -> dict:
    abi, seccomp = landlock_abi(), seccomp_missing()
    kernel = "" if abi and not seccomp else "; ".join(
        ([] if abi else ["Landlock: not in this kernel (or not enabled at boot)"]) + ([seccomp] if seccomp
                                                                                   else []))
    namespaces = _try("namespaces", abi) if requested in ("auto", "namespaces") and not kernel else ""
    if requested == "none":
        mode = "none"
    elif kernel:
        raise SystemExit(f"--tools python: no kernel isolation for model-written code here ({kernel}); "
                         f"--tool_sandbox none runs it under the audit hook alone, which is no boundary")
    elif namespaces is None:
        mode = "namespaces"
    elif requested == "namespaces":
        raise SystemExit(f"--tool_sandbox namespaces: this machine cannot create them ({namespaces}); see "
                         f"docs/tools.md (Ubuntu's AppArmor sysctl, Docker's seccomp profile), or use "
                         f"--tool_sandbox landlock")
    else:
        failed = _try("landlock", abi)
        if failed is not None:
            raise SystemExit(f"--tools python: Landlock ABI {abi} is there but a call could not be confined "
                             f"({failed}); --tool_sandbox none runs it under the audit hook alone")
        mode = "landlock"
    why = namespaces or f"--tool_sandbox {requested}"
    return {"mode": mode, "abi": abi, "line": _line(mode, abi, why)}


def _try(mode: str, abi: int):
    """None if a trivial call runs confined in `mode`, else why not (the call's one-line report)."""
    import tempfile
    scratch = tempfile.mkdtemp(prefix="probe-", dir=scratch_parent(""))
    try:
        config = call_config({"mode": mode, "abi": abi}, scratch, 256, 30)
        out, _, status, timed_out = run("print('ok')", config, 30, 4096)
    finally:
        remove_tree(scratch)
    text = out.decode("utf-8", "replace").strip()
    if timed_out:
        return "a trivial call did not finish in 30 s"
    last = (text.splitlines() or [f"exit status {status}"])[-1]
    return None if status == 0 and text == "ok" else last.removeprefix(f"rlmini sandbox: {mode}: ")


def _line(mode: str, abi: int, why_not_namespaces) -> str:
    """The one start-up line: what confines a python call and what stays open."""
    if mode == "none":
        return ("python tool sandbox: none (--tool_sandbox none): an audit hook and rlimits only; "
                "model-written code can switch the hook off and reach the network, other processes and the "
                "run folder")
    landlock = (f"Landlock ABI {abi} (read: system and Python folders; write: scratch"
                + ("; TCP" if abi >= 4 else "") + ("; signals, abstract sockets" if abi >= 6 else "") + ")")
    limits = "seccomp (one process, one thread; no chmod/xattr/mount/ptrace), no capabilities, rlimits"
    open_ = ["file metadata (stat) everywhere"]
    if abi < 6 and mode == "landlock":
        open_.append("signals to processes of the same user (Landlock ABI < 6)")
    if mode == "namespaces":
        return (f"python tool sandbox: namespaces (user, pid, net, mount, ipc, uts; a {SCRATCH_MB} MiB "
                f"scratch tmpfs) + {landlock} + {limits}; open: {', '.join(open_)}")
    open_ += [f"the scratch folder's total size ({SCRATCH_MB} MiB per file)",
              "other processes' ids (/proc stat)"]
    return (f"python tool sandbox: {landlock} + {limits} + no sockets, without namespaces "
            f"({why_not_namespaces}); open: {', '.join(open_)}")


def call_config(plan_: dict, scratch: str, memory_mb: int, timeout: float, forbidden=()) -> dict:
    """What `run` and the call's interpreter need: the plan's mode, the scratch folder, the limits (CPU: the
    wall-clock limit rounded up, plus a second), what may be read, and (mode none) the run folders."""
    return {"mode": plan_["mode"], "abi": plan_["abi"], "scratch": scratch, "memory": memory_mb << 20,
            "cpu": math.ceil(timeout) + 1, "read": read_paths(),
            "forbidden": [os.path.realpath(f) for f in forbidden]}


def run(code: str, config: dict, timeout: float, cap: int):
    """Run `code` in a call's interpreter confined as `config` says (mode, abi, scratch, memory, cpu, read,
    forbidden), in its own session (the whole process group is killed at the end). Reads at most `cap` bytes
    of its output (stdout and stderr) within `timeout` seconds of wall clock. Returns (output, bytes
    produced, exit status (negative: the signal), timed out)."""
    import select
    import subprocess
    start = time.perf_counter()
    chunks, size, timed_out = [], 0, False
    status_read, status_write = os.pipe() if config["mode"] == "namespaces" else (-1, -1)
    config = {**config, "status_fd": status_write}
    proc = subprocess.Popen(command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, cwd=config["scratch"], env=environment(config),
                            start_new_session=True, pass_fds=(status_write,) if status_write >= 0 else ())
    if status_write >= 0:
        os.close(status_write)
    try:
        proc.stdin.write(code.encode("utf-8", "replace"))
        proc.stdin.close()
    except BrokenPipeError:
        pass
    fd, deadline = proc.stdout.fileno(), start + timeout
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            timed_out = True
            break
        if not select.select([fd], [], [], left)[0]:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk[:max(cap - size, 0)])
        size += len(chunk)
        if size >= cap:  # enough to show: the rest is not read
            break
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the process and anything left in its session
    except (ProcessLookupError, PermissionError):
        pass
    proc.stdout.close()
    if status_read < 0:
        return b"".join(chunks), size, proc.wait(), timed_out
    with os.fdopen(status_read, "rb") as f:
        raw = f.read(4)
    status = os.waitstatus_to_exitcode(struct.unpack("i", raw)[0]) if len(raw) == 4 else -signal.SIGKILL
    threading.Thread(target=proc.wait, daemon=True).start()  # reaped while the namespaces are torn down
    return b"".join(chunks), size, status, timed_out


def command() -> list:
    """The call's interpreter: isolated mode (no user site, no environment variables read), and `main`."""
    return [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {_ROOT!r}); "
                                         f"from rlmini.sandbox import main; main()"]


def environment(config: dict) -> dict:
    """The call's whole environment: no variable of the trainer's (tokens, keys) reaches it."""
    scratch = config["scratch"]
    return {"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8",
            "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "RLMINI_SANDBOX": repr(config)}


def scratch_parent(run_dir: str, rank: int = 0) -> str:
    """The folder this run's call scratch folders go under, made empty the first time it is asked for and
    removed at exit: a run folder's rank gets one of its own (a killed trainer's leftovers are removed when
    the run starts again); other processes (eval.py, tests) one per process id, and those of processes that
    are gone are removed."""
    key = f"{os.path.realpath(run_dir)}#{rank}" if run_dir else ""
    with _LOCK:
        if key not in _PARENTS:
            _PARENTS[key] = _fresh_parent(key)
        return _PARENTS[key]


def _fresh_parent(key: str) -> str:
    import hashlib
    import tempfile
    tmp = tempfile.gettempdir()
    name = ("rlmini-tool-run-" + hashlib.sha256(key.encode()).hexdigest()[:12] if key
            else f"rlmini-tool-pid{os.getpid()}")
    for entry in os.listdir(tmp):  # a killed process's folder (another user's stays: not ours to remove)
        if entry.startswith("rlmini-tool-pid") and entry[15:].isdigit() and not _alive(int(entry[15:])):
            try:
                if _marked(os.path.join(tmp, entry)):
                    remove_tree(os.path.join(tmp, entry))
            except OSError:
                pass
    path = os.path.join(tmp, name)
    if os.path.lexists(path) and not _marked(path):
        raise SystemExit(f"--tools: {path} exists and was not made by rlmini (no {SCRATCH_MARKER}): not "
                         f"removed; move it, or set TMPDIR to another folder")
    remove_tree(path)  # ours (marked): a killed run's leftovers
    new = tempfile.mkdtemp(dir=tmp, prefix=".rlmini-tool-new-")  # marked before it is named: no window
    open(os.path.join(new, SCRATCH_MARKER), "w").close()
    os.rename(new, path)
    atexit.register(remove_tree, path)  # a finished process leaves none; a killed one, until its next start
    return path


SCRATCH_MARKER = ".rlmini-scratch"  # in every scratch parent this module made: the only ones it removes


def _marked(path: str) -> bool:
    """Whether `path` is a scratch parent of ours: a folder, owned by this user, holding the marker (or, made
    before the marker, holding nothing but calls' folders)."""
    try:
        if not os.path.isdir(path) or os.path.islink(path) or os.stat(path).st_uid != os.getuid():
            return False
        entries = os.listdir(path)
    except OSError:
        return False
    return SCRATCH_MARKER in entries or all(e.startswith(("call-", "probe-")) for e in entries)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def remove_tree(path: str) -> None:
    """Remove a scratch folder even where its modes were taken away (chmod 000 folders)."""
    import shutil

    def retry(function, failed, _):
        for p in (os.path.dirname(failed), failed):
            try:
                os.chmod(p, stat.S_IRWXU, follow_symlinks=False)
            except (OSError, NotImplementedError):
                pass
        try:
            (shutil.rmtree if os.path.isdir(failed) and not os.path.islink(failed) else os.remove)(failed)
        except FileNotFoundError:
            pass
    if os.path.lexists(path):
        shutil.rmtree(path, onerror=retry)


def check_run_dir(run_dir: str) -> None:
    """The run folder must lie outside what a call may read (Landlock cannot take a folder out of another)."""
    real = os.path.realpath(run_dir)
    inner = [p for p in read_paths() if _inside(real, p)]
    if inner:
        raise SystemExit(f"--tools python: the run folder {real} lies inside {inner[0]}, which the python "
                         f"tool may read; choose an --out_dir outside the system and Python folders")


# ------------------------------------------------------------------------------------- inside the call


def main() -> None:
    """A call's interpreter: read the code, confine this process (its config in RLMINI_SANDBOX), run the code.
    A step that fails is reported in one line, exit status SETUP_FAILED: the code never runs unconfined."""
    config = ast.literal_eval(os.environ.pop("RLMINI_SANDBOX"))
    source = sys.stdin.read()
    os.close(0)
    mode = config["mode"]
    try:
        if mode == "namespaces":
            _enter_namespaces(config["scratch"], config["status_fd"])
        _limit(config)
        if mode != "none":
            _drop_capabilities()
            _check(_prctl(PR_SET_NO_NEW_PRIVS, 1), "no_new_privs")
            _landlock(config["abi"], config["read"], config["scratch"])
            install_seccomp(seccomp_program(network=mode == "namespaces"))
    except SetupError as e:
        print(f"rlmini sandbox: {mode}: {e.strerror}", flush=True)
        os._exit(SETUP_FAILED)
    if mode == "none":
        sys.addaudithook(_audit_guard(config["scratch"], config["forbidden"]))
    _execute(source)


def _enter_namespaces(scratch: str, status_fd: int) -> None:
    """Into new user, mount, PID, network, IPC and UTS namespaces, the scratch folder a tmpfs of the mount
    namespace; then fork PID 1 of the new PID namespace (when it ends, the kernel kills every process left in
    it), which forks the process that returns and runs the code, and writes its wait status to `status_fd`
    (the trainer has it then, before the namespaces' teardown, which can take seconds on a loaded machine)."""
    uid, gid = os.geteuid(), os.getegid()
    _check(_libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC
                         | CLONE_NEWUTS | CLONE_NEWCGROUP), "unshare")
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        try:
            with open(f"/proc/self/{name}", "w") as f:  # the same ids inside: files keep their owners
                f.write(text)
        except OSError as e:
            raise SetupError(e.errno, f"/proc/self/{name}: {e.strerror}") from None
    _check(_libc.mount(None, b"/", None, ctypes.c_ulong(MS_REC | MS_PRIVATE), None),
           "mount --make-rprivate /")
    options = f"size={SCRATCH_MB}m,nr_inodes={SCRATCH_INODES},mode=700".encode()
    _check(_libc.mount(b"tmpfs", scratch.encode(), b"tmpfs", ctypes.c_ulong(MS_NOSUID | MS_NODEV), options),
           "mount the scratch tmpfs")
    os.chdir(scratch)  # the tmpfs, not the folder under it
    sys.stdout.flush()
    init = os.fork()
    if init == 0:  # PID 1 of the namespace: the kernel drops signals it sends itself, so it runs no code
        _check(_prctl(PR_SET_PDEATHSIG, signal.SIGKILL), "PR_SET_PDEATHSIG")  # if the supervisor is killed
        worker = os.fork()
        if worker == 0:
            os.close(status_fd)
            return
        os.write(status_fd, struct.pack("i", os.waitpid(worker, 0)[1]))
        os._exit(0)
    os.close(status_fd)  # init's copy is the only one left: killed before it writes, the trainer reads EOF
    os.waitpid(init, 0)
    os._exit(0)


def _limit(config: dict) -> None:
    """rlimits: address space, CPU seconds, file size, no core files, open files; one task (none more in a
    namespace's user; the count is per user and ignored for uid 0, where seccomp is what holds)."""
    limits = [(resource.RLIMIT_AS, config["memory"]), (resource.RLIMIT_CPU, config["cpu"]),
              (resource.RLIMIT_FSIZE, SCRATCH_MB << 20), (resource.RLIMIT_CORE, 0),
              (resource.RLIMIT_NOFILE, OPEN_FILES)]
    if config["mode"] == "namespaces":
        limits.append((resource.RLIMIT_NPROC, 3))  # the call, its init, its supervisor: all the user's there
    elif config["mode"] == "landlock":
        limits.append((resource.RLIMIT_NPROC, 1))
    for kind, value in limits:
        hard = value + 1 if kind == resource.RLIMIT_CPU else value  # SIGXCPU at the soft limit, then SIGKILL
        try:
            resource.setrlimit(kind, (value, hard))
        except (ValueError, OSError) as e:
            raise SetupError(errno.EPERM, f"setrlimit {kind}: {e}") from None


def _drop_capabilities() -> None:
    """No capability in any set, none to gain from exec (bounding set empty, securebits locked); a user
    without capabilities (EPERM on the privileged steps) has nothing to drop."""
    _prctl(PR_SET_SECUREBITS, SECUREBITS)
    for cap in range(64):
        if _prctl(PR_CAPBSET_DROP, cap) < 0 and ctypes.get_errno() == errno.EINVAL:
            break  # past the last capability this kernel knows
    _prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    header = struct.pack("Ii", CAPABILITY_V3, 0)
    _check(_libc.capset(header, bytes(24)), "capset")


def _landlock(abi: int, read: list, scratch: str) -> None:
    """A Landlock domain: every filesystem right this ABI knows is handled, so only the rules below allow:
    read the `read` folders, read and write (no execute) the scratch folder, /dev/null; TCP bind and connect
    handled with no port allowed (ABI 4); signals and abstract unix sockets scoped to the domain (ABI 6)."""
    fs = FS_ABI1 | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0) | (
        FS_IOCTL_DEV if abi >= 5 else 0)
    net = NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0
    attr = struct.pack("QQQ", fs, net, scoped)[:8 if abi < 4 else 16 if abi < 6 else 24]
    ruleset = _check(_libc.syscall(ctypes.c_long(LANDLOCK_CREATE_RULESET), attr, ctypes.c_size_t(len(attr)),
                                   ctypes.c_uint32(0)), "landlock_create_ruleset")
    file_rights = FS_READ_FILE | FS_WRITE_FILE | (FS_TRUNCATE if abi >= 3 else 0)
    rules = [(p, FS_READ_FILE | FS_READ_DIR) for p in read] + [(scratch, fs & ~FS_EXECUTE),
                                                                (os.devnull, file_rights)]
    for path, rights in rules:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue  # a folder this machine does not have
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            rights &= FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV  # a file's
        rule = struct.pack("=Qi", rights, fd)  # struct landlock_path_beneath_attr is packed
        _check(_libc.syscall(ctypes.c_long(LANDLOCK_ADD_RULE), ruleset,
                             ctypes.c_int(LANDLOCK_RULE_PATH_BENEATH), rule, ctypes.c_uint32(0)),
               f"landlock_add_rule {path}")
        os.close(fd)
    _check(_libc.syscall(ctypes.c_long(LANDLOCK_RESTRICT_SELF), ruleset, ctypes.c_uint32(0)),
           "landlock_restrict_self")
    os.close(ruleset)


def seccomp_program(network: bool, denied=None) -> bytes:
    """A classic-BPF seccomp filter: another architecture's syscalls (and x32's) kill the process; the
    `denied` syscalls ({name: errno}; default: every one in _DENIED, EPERM) fail with that error; socket()
    is allowed for AF_INET and AF_INET6 only where `network` (an empty network namespace holds them), for no
    family otherwise, and for any where `network` is None; everything else is allowed."""
    arch, numbers = SYSCALLS[os.uname().machine]
    denied = dict.fromkeys(_DENIED, errno.EPERM) if denied is None else dict(denied)
    if network is False:
        denied["socket"] = errno.EPERM

    def op(code, k, jt=0, jf=0):
        return struct.pack("HBBI", code, jt, jf, k)

    prog = [op(LD_W_ABS, 4), op(JEQ_K, arch, 1, 0), op(RET_K, RET_KILL_PROCESS), op(LD_W_ABS, 0)]
    if os.uname().machine == "x86_64":
        prog += [op(JGE_K, X32_BIT, 0, 1), op(RET_K, RET_KILL_PROCESS)]
    for name, err in denied.items():
        if name in numbers:
            prog += [op(JEQ_K, numbers[name], 0, 1), op(RET_K, RET_ERRNO | err)]
    if network:  # socket(domain, ...): args[0]'s low 32 bits at offset 16
        prog += [op(JEQ_K, numbers["socket"], 0, 4), op(LD_W_ABS, 16), op(JEQ_K, AF_INET, 2, 0),
                 op(JEQ_K, AF_INET6, 1, 0), op(RET_K, RET_ERRNO | errno.EPERM)]
    prog.append(op(RET_K, RET_ALLOW))
    return b"".join(prog)


def install_seccomp(program: bytes) -> None:
    """Install a seccomp filter on this process and, once it is set, on every process it starts."""
    _check(_prctl(PR_SET_NO_NEW_PRIVS, 1), "no_new_privs")  # what an unprivileged filter requires

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]

    prog = Fprog(len(program) // 8, program)
    _check(_libc.prctl(ctypes.c_int(PR_SET_SECCOMP), ctypes.c_ulong(2), ctypes.byref(prog), ctypes.c_ulong(0),
                       ctypes.c_ulong(0)), "seccomp")


def _audit_guard(scratch: str, forbidden: list):
    """--tool_sandbox none: an audit hook refusing fork, exec, signals, sockets, chdir, writes outside the
    scratch folder and any access to the run folder. Advisory: code gets around it (ctypes, dir_fd, ...)."""
    scratch = os.path.realpath(scratch)
    forbidden = [os.path.realpath(p) for p in forbidden]
    refused = {"os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.kill",
               "os.killpg", "subprocess.Popen", "pty.spawn", "os.chdir", "socket.connect", "socket.bind"}
    writes = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink",
              "os.link", "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "shutil.copyfile"}

    def guard(event, args):
        if event in refused:
            raise PermissionError(f"{event} is not allowed in the python tool")
        if event in ("open", "os.listdir", "os.scandir") or event in writes:
            path = args[0] if args else None
            path = os.fsdecode(path) if isinstance(path, bytes) else path
            if not isinstance(path, str):
                return
            mode, flags = (args[1], args[2]) if event == "open" else (None, 0)
            write = (event in writes or isinstance(mode, str) and any(c in mode for c in "wax+")
                     or isinstance(flags, int)
                     and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC))
            path = os.path.realpath(path)
            if write and not _inside(path, scratch) or any(_inside(path, f) for f in forbidden):
                raise PermissionError(f"the python tool may not {'write' if write else 'read'} {path}")
    return guard


def _execute(source: str) -> None:
    """Run the code as a notebook cell (a final expression's value is printed); an exception's traceback from
    the tool's own frames on, exit status 1."""
    try:
        tree = ast.parse(source, "<tool>")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        namespace = {"__name__": "__main__"}
        exec(compile(tree, "<tool>", "exec"), namespace)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), "<tool>", "eval"), namespace)
            if value is not None:
                print(repr(value))
    except BaseException as e:
        import traceback
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != "<tool>":
            tb = tb.tb_next
        lines = (traceback.format_exception(type(e), e, tb) if tb is not None
                 else traceback.format_exception_only(type(e), e))
        sys.stdout.flush()
        sys.stderr.write("".join(lines))
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
