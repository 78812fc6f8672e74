"""Checks on the files and folders a command will write, made before the run starts: a
simulation or a benchmark of minutes whose results then cannot be written is lost work."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from servelab.errors import InvalidArgument


def check_output_file(path: str | None, flag: str) -> None:
    """`path` can be created or overwritten: its folder exists and takes a new file, it is no folder."""
    if path is None:
        return
    target = Path(path)
    if target.is_dir():
        raise InvalidArgument(f"{flag}: {path!r} is a directory; give a file name")
    folder = target.resolve().parent
    if not folder.is_dir():
        raise InvalidArgument(f"{flag}: directory {str(folder)!r} does not exist")
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise InvalidArgument(f"{flag}: cannot write {path!r} (permission denied)")
    _try_create_in(folder, flag, path)


def check_plot_file(path: str | None, flag: str) -> None:
    """As check_output_file, and matplotlib can write the file's format (from its extension)."""
    if path is None:
        return
    check_output_file(path, flag)
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix:
        # backend_bases lists the formats savefig knows without importing pyplot or a GUI backend
        from matplotlib.backend_bases import FigureCanvasBase

        formats = FigureCanvasBase.get_supported_filetypes()
        if suffix not in formats:
            raise InvalidArgument(
                f"{flag}: cannot plot to {path!r}: format {suffix!r} is not one of {', '.join(sorted(formats))}"
            )


def _try_create_in(folder: Path, flag: str, path: str) -> None:
    """Permission bits do not tell everything (root passes os.access, yet /proc or a read-only
    mount refuse a new file): create, then remove, a temporary file in `folder`."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".servelab-write-check-"):
            pass
    except OSError as exc:
        raise InvalidArgument(f"{flag}: cannot write {path!r} ({exc.strerror or exc})") from None


def check_output_dir(path: str | None, flag: str) -> None:
    """`path` is a folder, or can be made one (its nearest existing ancestor is a writable folder)."""
    if path is None:
        return
    target = Path(path).resolve()
    if target.exists() and not target.is_dir():
        raise InvalidArgument(f"{flag}: {path!r} exists and is not a directory")
    ancestor = target
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise InvalidArgument(f"{flag}: cannot create {path!r}: {str(ancestor)!r} is not a directory")
    if not os.access(ancestor, os.W_OK):
        raise InvalidArgument(f"{flag}: cannot write into {str(ancestor)!r} (permission denied)")
    if target.is_dir():
        _try_create_in(target, flag, path)
    else:
        try:  # a test folder where `path`'s first missing folder goes, removed again
            probe = Path(tempfile.mkdtemp(dir=ancestor, prefix=".servelab-write-check-"))
        except OSError as exc:
            raise InvalidArgument(f"{flag}: cannot create {path!r} ({exc.strerror or exc})") from None
        probe.rmdir()
