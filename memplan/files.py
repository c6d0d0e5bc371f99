"""Output files written whole or not at all: a temporary file beside the target, renamed over it.

Every file memplan writes (``--plot``, ``--torch-trace``, ``--memory-snapshot``) goes through ``replaced``:
the writer fills a temporary file in the target's own folder (``.NAME.XXXXXXXX.SUFFIX``, the suffix kept
so that a writer picking the format from it, matplotlib's ``savefig``, picks the same), and only a
complete file is renamed onto the target with ``os.replace`` (atomic within one file system, POSIX
``rename(2)``). On any failure (a full disk, a write error, an exception of the writer) the temporary file
is removed and the target, if it existed, is left exactly as it was; the error is a one-line
``ValueError`` naming the option and the file (the CLI prints it and exits 2).

The new file gets the mode a plain ``open(path, "w")`` would give it (``0o666`` less the umask), or the
replaced file's own mode; a symbolic link as target is written through (the file it points to is
replaced, the link kept).

Pure Python, no torch (``memplan estimate --plot`` must not load it).

NB: a crash of the whole process between creating and removing the temporary file (SIGKILL, power loss)
leaves it behind, hidden (its name starts with a dot); the target is intact either way. The rename is
not followed by an ``fsync`` of the folder: after a power loss the old or the new file is there, as
the kernel last wrote it.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

_FIXES = {
    errno.ENOSPC: "free space on that disk or write elsewhere",
    errno.EDQUOT: "free space within your quota or write elsewhere",
    errno.EFBIG: "write a smaller file or elsewhere",
    errno.EACCES: "check the folder's permissions or write elsewhere",
    errno.EPERM: "check the folder's permissions or write elsewhere",
    errno.EROFS: "the file system is read-only; write elsewhere",
}


def write_failed(option: str, path: str, exc: OSError) -> ValueError:
    """The one-line error for a failed write of ``path`` (``--option``): what went wrong and the fix."""
    fix = _FIXES.get(exc.errno or 0, "check the path, the free space and the permissions")
    what = exc.strerror or str(exc) or type(exc).__name__
    return ValueError(f"{option}: cannot write {path}: {what}; {fix} (an existing {path} is left unchanged)")


def _mode(target: Path) -> int:
    """The mode the written file gets: the replaced file's, else what ``open(path, "w")`` gives."""
    try:
        return stat.S_IMODE(target.stat().st_mode)
    except OSError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


@contextmanager
def replaced(path: str, option: str) -> Iterator[str]:
    """Yield a temporary path in ``path``'s folder to write; on leaving the block without an error, rename
    it onto ``path``. On an error the temporary file is removed and ``path`` untouched; an ``OSError``
    becomes ``write_failed``'s one-line ``ValueError``, anything else is re-raised as it was."""
    target = Path(os.path.realpath(path))  # through a symlink: replace the file, keep the link
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=target.suffix, dir=target.parent)
    except OSError as exc:
        raise write_failed(option, path, exc) from None
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, _mode(target))
        os.replace(tmp, target)
    except OSError as exc:
        _remove(tmp)
        raise write_failed(option, path, exc) from None
    except BaseException:
        _remove(tmp)
        raise


def _remove(tmp: str) -> None:
    Path(tmp).unlink(missing_ok=True)


def write_with(path: str, option: str, write: Callable[[str], object]) -> None:
    """``write(tmp)`` into a temporary file, renamed onto ``path`` when complete (``replaced``)."""
    with replaced(path, option) as tmp:
        write(tmp)
