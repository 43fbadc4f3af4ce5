"""Writing files so that a failure never leaves half a file where a good one was.

Every writer of the application (checkpoints, indexes, exports, ``idml embed`` outputs, reports)
goes through :func:`write_file`: the bytes are made in memory first (so their size is known, and a
serializer's own I/O errors, such as safetensors' or libtorch's, cannot occur half-way through a
file), written to a hidden temporary file next to the target, flushed to the disk (``fsync``) and
renamed over the target (``os.replace``, atomic on POSIX), and the folder's entry is flushed too.
A reader sees the old file or the new one, never a mixture.

A failed write (disk full, permissions, a read-only disk) removes its temporary file and raises
:class:`WriteError`, whose message names the folder, the bytes needed and the bytes free, and what
stays as it was: the caller says that in ``kept`` (e.g. "the previous checkpoint stays latest").
"""

from __future__ import annotations

import errno as errno_codes
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


class WriteError(OSError):
    """A write that failed; its temporary files are removed and the message says what was kept.

    An :class:`OSError` (``errno`` is the cause's), so the CLI prints it as one line (exit 2).
    """

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        self.errno = code
        self.message = message

    def __str__(self) -> str:
        return self.message


def format_bytes(n: int | None) -> str:
    """``1536`` → ``"1.5 KiB"`` (``"?"`` when unknown)."""
    if n is None:
        return "?"
    size = float(n)
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} bytes" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def free_bytes(folder: Path) -> int | None:
    """Bytes free on the filesystem of ``folder`` (or of its nearest existing parent)."""
    for candidate in (folder, *folder.parents):
        try:
            return shutil.disk_usage(candidate).free
        except OSError:
            continue
    return None


def write_failure(
    err: OSError,
    folder: Path,
    what: str,
    needed: int | None,
    kept: str,
    then: str = "run again",
) -> WriteError:
    """The :class:`WriteError` of ``err`` while writing ``what`` (``needed`` bytes) into
    ``folder``; ``kept`` says what is unchanged, ``then`` what to do once the cause is fixed."""
    if isinstance(err, WriteError):
        return err
    reason = err.strerror or str(err) or type(err).__name__
    space = f" ({format_bytes(needed)} needed, {format_bytes(free_bytes(folder))} free)"
    fix = (
        "free disk space"
        if err.errno in (errno_codes.ENOSPC, errno_codes.EDQUOT)
        else "check the folder's permissions and free space"
    )
    return WriteError(
        f"cannot write {what} into {folder}: {reason}{space}; {kept}. {fix.capitalize()}, then "
        f"{then}",
        err.errno,
    )


def fsync_folder(folder: Path) -> None:
    """Flush a folder's entries (a rename is durable only once its folder is); a no-op where the
    platform cannot open folders."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temporary_name(path: Path) -> Path:
    """The hidden temporary file a write of ``path`` goes through (this process's own)."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def write_file(path: Path, data: bytes, *, what: str | None = None, kept: str = "") -> int:
    """Write ``data`` to ``path`` atomically (module docstring); returns the bytes written.

    On failure the temporary file is removed and :class:`WriteError` says ``kept`` (what is still
    as it was; default: "the previous {path.name} is unchanged" or "nothing was written").
    """
    path = Path(path)
    tmp = temporary_name(path)
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as err:
        remove_quietly(tmp)
        if not kept:
            kept = (
                f"the previous {path.name} is unchanged" if path.exists() else "nothing was written"
            )
        raise write_failure(err, path.parent, what or path.name, len(data), kept) from err
    fsync_folder(path.parent)
    return len(data)


def write_new_files(folder: Path, files: dict[str, bytes]) -> None:
    """Write ``files`` (name → bytes) into ``folder``, a temporary folder of the caller's that is
    renamed into place once complete; each file and the folder's entries are flushed to disk.
    Raises the :class:`OSError` as it is: the caller removes the folder and reports it."""
    for name, data in files.items():
        with open(folder / name, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    fsync_folder(folder)


def atomic_write_text(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through :func:`write_file`."""
    write_file(Path(path), text.encode("utf-8"))


@contextmanager
def reported_write(folder: Path, what: str, needed: int | None, kept: str) -> Iterator[None]:
    """Turn an :class:`OSError` inside the block into the :class:`WriteError` of :func:`write_failure`
    (for writes made of several files, whose caller cleans up its own temporary folder)."""
    try:
        yield
    except OSError as err:
        raise write_failure(err, folder, what, needed, kept) from err


def remove_quietly(path: Path) -> None:
    """Remove a temporary file or folder; a failure to clean up never hides the real error."""
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    except OSError:
        pass
