"""The terminal holds our own lines: the start-up lines, the progress, warnings, errors and the final lines.
What the libraries print (vLLM's and transformers' logging, Python warnings, progress bars, C++ notices such
as NUMA's on file descriptors 1 and 2, subprocesses') goes to the run folder's logs/rank<R>.log instead, one
file per rank; --verbose true leaves it all on the terminal, as the libraries print it, and writes no log.

How: from common.setup on, inside a train_*.py entry point (faults.user_errors), descriptors 1 and 2 point at
the log, and sys.stdout and sys.stderr at copies of the terminal's, so that Python's print, the progress bar,
tracebacks and SystemExit messages reach the terminal while anything writing to the descriptors, or to
sys.__stdout__ / sys.__stderr__ (where the libraries' handlers are made to write), reaches the log. Until the
run folder exists (prepare_run_dir, after the task, the model and its tokenizer) the log is a temporary file
whose content then moves into logs/rank<R>.log; a run that stops before that leaves no log (--verbose true
shows what the libraries said). The entry point's end restores the terminal before the error line is printed.
"""
import contextlib
import logging
import os
import sys
import tempfile
import warnings

from rlmini import dist

# entry: inside a train_*.py entry point; while the output is moved, the terminal's descriptors, the log
_STATE = {"entry": False}


@contextlib.contextmanager
def entry_point():
    """The scope within which common.setup may move the libraries' output (faults.user_errors): outside it
    (tests, a notebook) nothing moves; at its end the terminal is restored, an error being printed after."""
    _STATE["entry"] = True
    try:
        yield
    finally:
        _STATE["entry"] = False
        stop()


def active() -> bool:
    """The libraries' output goes to a log now."""
    return "terminal" in _STATE


def start(args) -> None:
    """Inside an entry point, without --verbose, and on the process's own streams: the libraries' output to a
    temporary log from now on (to_run_dir moves it into the run folder)."""
    captured = sys.stdout is not sys.__stdout__ or sys.stderr is not sys.__stderr__  # pytest, a notebook
    if not _STATE["entry"] or args.verbose or active() or captured:
        return
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")  # bars write to sys.stderr, the terminal
    from transformers.utils import logging as hf_logging
    hf_logging.get_logger()  # transformers' handler made now, on sys.__stderr__ (the log)
    hf_logging.disable_progress_bar()  # its loading and saving bars, and the hub's downloads
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    log = tempfile.TemporaryFile()
    _STATE.update(terminal=(os.dup(1), os.dup(2)), log=log, showwarning=warnings.showwarning,
                  last_resort=logging.lastResort)
    _point_descriptors(log.fileno())
    # the copies close with these streams (a progress bar may hold one), never while they write
    sys.stdout, sys.stderr = (open(fd, "w", buffering=1, encoding=s.encoding, errors=s.errors)
                              for fd, s in zip(_STATE["terminal"], (sys.__stdout__, sys.__stderr__)))
    warnings.showwarning = _warning_to_log
    logging.lastResort = logging.StreamHandler(sys.__stderr__)  # a logger without handlers (vLLM's at import)
    logging.lastResort.setLevel(logging.WARNING)


@contextlib.contextmanager
def to_log():
    """While quiet, what is printed to sys.stdout and sys.stderr (wandb's banner, notices and summary, which
    write there at call time) goes to the log too."""
    if not active():
        yield
        return
    streams = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    try:
        yield
    finally:
        sys.__stdout__.flush()
        sys.__stderr__.flush()
        sys.stdout, sys.stderr = streams


def to_run_dir(run_dir: str, resume: bool) -> None:
    """The log so far into run_dir/logs/rank<R>.log (appended to on --resume), which gets the rest."""
    if not active():
        return
    os.makedirs(os.path.join(run_dir, "logs"), exist_ok=True)
    log = open(os.path.join(run_dir, "logs", f"rank{dist.rank()}.log"), "ab" if resume else "wb")
    sys.__stdout__.flush()
    sys.__stderr__.flush()
    _STATE["log"].seek(0)
    log.write(_STATE["log"].read())
    log.flush()
    _point_descriptors(log.fileno())
    _STATE["log"].close()
    _STATE["log"] = log
    # a library imported since start (datasets) made its handler on sys.stderr, the terminal
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for handler in getattr(logger, "handlers", ()):
            if vars(handler).get("stream") in (sys.stdout, sys.stderr):  # not a property: it can be set
                handler.setStream(sys.__stderr__)


def stop() -> None:
    """The terminal back on descriptors 1 and 2, sys.stdout and sys.stderr back to Python's own."""
    if not active():
        return
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        stream.flush()
    for fd, saved in zip((1, 2), _STATE["terminal"]):
        os.dup2(saved, fd)
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    warnings.showwarning, logging.lastResort = _STATE["showwarning"], _STATE["last_resort"]
    _STATE["log"].close()
    for key in ("terminal", "log", "showwarning", "last_resort"):
        del _STATE[key]


def _point_descriptors(fd: int) -> None:
    for target in (1, 2):
        os.dup2(fd, target)


def _warning_to_log(message, category, filename, lineno, file=None, line=None) -> None:
    (file or sys.__stderr__).write(warnings.formatwarning(message, category, filename, lineno, line))
