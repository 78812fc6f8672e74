"""Checks on the files and folders a command will write, made before the run starts: a
simulation or a benchmark of minutes whose results then cannot be written is lost work."""

from __future__ import annotations

import os
from pathlib import Path

from servelab.errors import InvalidArgument


def check_output_file(path: str | None, flag: str) -> None:
    """`path` can be created or overwritten: its folder exists and is writable, it is no folder."""
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
