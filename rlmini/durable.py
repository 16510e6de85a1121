"""Durable writes and owned removals, for every program here: a file or folder is published by a rename that
is then made durable (an fsync of the folder holding it: POSIX makes a rename durable only once its folder is
synced, fsync(2) "Calling fsync() does not necessarily ensure that the entry in the directory containing the
file has also reached disk"), a folder's files are fsynced before it is published, and a removal takes only
what a program of ours wrote: a named entry carrying its marker (docs/outputs.md lists them)."""
import errno
import os
import shutil

# fsync of a folder is refused by some filesystems (EINVAL) or not offered (ENOTSUP): there, nothing more can
# be done, and the rename stands as the filesystem keeps it
_NO_DIR_SYNC = (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF, errno.EACCES, errno.EPERM)


def fsync_dir(path: str) -> None:
    """The folder's entries (a rename into it, a removal) on disk."""
    try:
        fd = os.open(path or ".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as e:
        if e.errno in _NO_DIR_SYNC:
            return
        raise
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _NO_DIR_SYNC:
            raise
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    """Every file under `path` and every folder, the deepest first, on disk (what save_pretrained, a tokenizer
    or a safetensors writer leave in the page cache)."""
    for folder, _, files in os.walk(path, topdown=False):
        for name in files:
            file = os.path.join(folder, name)
            if os.path.islink(file):
                continue
            fd = os.open(file, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(folder)


def publish(tmp: str, path: str) -> None:
    """tmp (a finished file, or a finished folder of synced files) renamed to path (a file over a file), and
    the rename on disk."""
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_text(path: str, text: str) -> None:
    """`text` into `path` atomically and durably: a temporary file beside it, fsynced, renamed over it, the
    folder fsynced; a reader sees the old file or the new one, after a power cut too."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    publish(tmp, path)


def remove(path: str) -> None:
    """Remove a file or a folder (its contents too) that the caller has shown to be ours, and make the removal
    durable. A folder is renamed aside first (path.removed) so that a removal cut short never leaves a half
    folder under its name for a reader to take."""
    if not os.path.lexists(path):
        return
    if os.path.isdir(path) and not os.path.islink(path):
        doomed = f"{path}.removed"
        if os.path.lexists(doomed):  # an earlier removal of ours cut short (same name, same owner)
            shutil.rmtree(doomed, ignore_errors=True)
        os.rename(path, doomed)
        fsync_dir(os.path.dirname(os.path.abspath(path)))
        shutil.rmtree(doomed)
    else:
        os.remove(path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def inside(path: str, folder: str) -> bool:
    """Whether `path` is `folder` or lies under it (symbolic links resolved)."""
    p, f = os.path.realpath(path), os.path.realpath(folder)
    return p == f or p.startswith(f.rstrip(os.sep) + os.sep)
