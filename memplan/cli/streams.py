"""The process's terminal and standard streams, made safe before any command runs (``app.main``).

- ``COLUMNS`` / ``LINES`` that are not a positive whole number are treated as unset: rich takes
  ``COLUMNS=0`` as a width of 0 and prints nothing at all (exit 0); unset, it asks the terminal, or
  uses 80 columns when there is none.
- stdout closed (``memplan … >&-``): Python then has no ``sys.stdout`` (None) and every print is
  silently dropped; memplan says so on stderr and exits 2 instead of "succeeding" with no output.
- stdout in an encoding that cannot write memplan's characters (``PYTHONIOENCODING=ascii``, a C locale):
  unencodable characters are replaced (``?``), rich draws its boxes in ASCII itself; no
  ``UnicodeEncodeError``. JSON is ASCII already (``json.dumps`` escapes).
- a failed write to stdout (``> /dev/full``: ENOSPC; an I/O error) is an ``OSError`` whose filename is
  ``stdout``, so the one-line error names it (``cli.common.user_errors``, ``app.main``); the last flush
  at exit is checked too (``finish``). A closed pipe (EPIPE, ``| head``) stays click's own case.
- SIGTERM and SIGHUP exit through Python's clean-up (exit code 143, 129), not where they land
  (``exit_on_termination``).

Pure Python, no torch.

NB: the stdout wrapper is installed only over Python's own ``io.TextIOWrapper`` (a console script, ``python
-m memplan``); a caller that replaced ``sys.stdout`` (pytest's capture, ``CliRunner``) keeps its own.
"""

from __future__ import annotations

import codecs
import io
import os
import signal
import sys
import threading
from typing import Any

EXIT_STREAM = 2
"""Exit code when the output cannot be written (memplan's code for what the user can fix)."""

_SAMPLE = "─│✓×≤²"
"""Characters memplan prints (rich's box lines, verdict marks, units): the encoding must write them all."""


def sane_terminal_env() -> None:
    """Drop ``COLUMNS`` and ``LINES`` unless each is a positive whole number (see the module docstring)."""
    for name in ("COLUMNS", "LINES"):
        value = os.environ.get(name)
        if value is not None and not (value.strip().isdigit() and int(value) > 0):
            del os.environ[name]


def _terminated(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def exit_on_termination() -> None:
    """SIGTERM and SIGHUP end the command as an exception (``SystemExit(128 + signal)``, exit code 143 or
    129, no traceback) rather than at once: ``finally`` blocks and context managers run, so a file being
    written leaves no temporary behind (``memplan.files``) and temporary folders are removed. (Python's
    own default kills the process where it stands.) Main thread only; ``profile --nproc`` installs its
    own while its ranks run (``measure.distributed.launch.spawn.spawn_ranks``)."""
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, _terminated)


def stdout_error(exc: OSError) -> OSError:
    """``exc`` as raised by a write to stdout: the same errno (and subclass: EPIPE stays a
    BrokenPipeError), with the filename ``stdout``."""
    return OSError(exc.errno, exc.strerror or str(exc), "stdout")


class _Stdout(io.TextIOWrapper):
    """Python's stdout wrapper whose write errors name ``stdout``."""

    def write(self, s: str) -> int:
        try:
            return super().write(s)
        except OSError as exc:
            raise stdout_error(exc) from None

    def flush(self) -> None:
        try:
            super().flush()
        except OSError as exc:
            raise stdout_error(exc) from None


def _writes_all(encoding: str) -> bool:
    try:
        codecs.encode(_SAMPLE, encoding)
    except (UnicodeEncodeError, LookupError):
        return False
    return True


def prepare() -> None:
    """Fix the environment and stdout before a command runs (and SIGTERM's effect:
    ``exit_on_termination``); exit 2 when stdout is closed."""
    exit_on_termination()
    sane_terminal_env()
    out: Any = sys.stdout
    if out is None:
        if sys.stderr is not None:
            print(
                "error: stdout: it is closed, and memplan prints its answer there; "
                "run it with stdout open (>/dev/null to discard the output)",
                file=sys.stderr,
            )
        raise SystemExit(EXIT_STREAM)
    if type(out) is not io.TextIOWrapper:
        return
    errors = out.errors if _writes_all(out.encoding) else "replace"
    wrapped = _Stdout(out.detach(), encoding=out.encoding, errors=errors, line_buffering=out.line_buffering)
    sys.stdout = wrapped
    if sys.__stdout__ is out:
        sys.__stdout__ = wrapped  # type: ignore[misc]  # the detached one must not be written to


def finish(code: Any) -> Any:
    """Flush stdout at the end of a command; a failure is one line on stderr and exit code 2 (unless the
    command failed already). Afterwards fd 1 points to /dev/null, so the interpreter's own last flush of
    the unwritten rest cannot fail again (Python's documented way for a closed pipe, docs.python.org
    "Note on SIGPIPE")."""
    try:
        if sys.stdout is not None:
            sys.stdout.flush()
    except OSError as exc:
        if exc.errno is not None and exc.errno != 32:  # EPIPE: a reader that stopped (| head), not an error
            print(f"error: {stream_message(exc)}", file=sys.stderr)
            code = code or EXIT_STREAM
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return code


def stream_message(exc: OSError) -> str:
    """``stdout: No space left on device; …`` for a failed write to stdout."""
    what = exc.strerror or str(exc)
    return f"stdout: cannot write the output: {what}; free space on that disk or redirect stdout elsewhere"
