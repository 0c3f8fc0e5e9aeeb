"""Writing the trace tools' output files safely: one helper for the .smtrace, the HTML report, the PNG
and the exported pickle.

- check_output(path, inputs) before the work (for `supermem trace`, before the program runs): the
  directory exists and is writable, the path is not a directory or a device, and it is none of the
  inputs (also not through a link), so a long run never ends in an unwritable path or a lost input.
- atomic_output(path): a temporary file in the same directory, renamed over `path` only once complete;
  on any failure the temporary file is removed and `path` keeps its old content.
Both raise OutputError naming the file; the CLI prints it as one line.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from ..errors import UsageError


class OutputError(UsageError):
    """An output path that cannot or must not be written (missing directory, a directory, a device,
    an input of the same command, or a failed write)."""


def same_file(a: Path, b: Path) -> bool:
    """True when a and b name one file: through links (hard or symbolic) too, or, when either does not
    exist yet, the same resolved path."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # either does not exist: compare where they would be
        return a.resolve() == b.resolve()


def check_output(path: str | os.PathLike, inputs: Iterable[str | os.PathLike] = ()) -> Path:
    """Raises OutputError unless `path` can be written as a new regular file without touching an input."""
    path = Path(path)
    for src in inputs:
        if same_file(path, Path(src)):
            raise OutputError(f"{path}: is the same file as the input {src}; choose another output")
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise OutputError(f"{path}: cannot be written ({e.strerror})") from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise OutputError(f"{path}: is a directory; give a file name")
    if st is not None and not stat.S_ISREG(st.st_mode):
        # Renaming a file over a device (as root) would replace it; writing into it is not atomic.
        raise OutputError(f"{path}: is not a regular file (a device or a pipe); give a file name")
    parent = path.parent
    if not parent.is_dir():
        raise OutputError(f"{path}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputError(f"{path}: the directory {parent} is not writable")
    return path


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike) -> Iterator[BinaryIO]:
    """A binary file to write `path`'s new content into; it replaces `path` when the block ends without
    an exception. OSErrors become OutputError naming `path`."""
    path = check_output(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:  # mode 0666 less the umask, as open() gives (mkstemp would make it 0600)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    except OSError as e:
        raise OutputError(f"{path}: cannot be written ({e.strerror})") from None
    try:
        with contextlib.suppress(FileNotFoundError):  # a file replaced keeps its mode (a 0600 stays private)
            os.fchmod(fd, stat.S_IMODE(os.stat(path).st_mode))
        with os.fdopen(fd, "wb") as f:
            yield f
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise OutputError(f"{path}: write failed ({e.strerror or e})") from None
        raise


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Writes `data` to `path` atomically."""
    with atomic_output(path) as f:
        f.write(data)
    return Path(path)
