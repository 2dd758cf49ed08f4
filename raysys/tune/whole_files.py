"""The local file system a sweep's Ray Tune state is written through: every file whole or not at all.

Ray Tune 2.60 keeps a sweep's state (``experiment_state-*.json``: which trials finished, with what)
in a staging folder under ``/tmp/ray`` and copies it to the sweep's folder with pyarrow, writing each
file in place. A disk that fills during that copy (or a kill mid-copy) leaves the file cut short: the
last good state is gone, and ``--resume`` found nothing Tune could read and started the sweep afresh.
Through :func:`whole_files_fs`, each file Tune writes goes to a temporary file beside it that replaces
the old one only once it is whole (the same rename raysys's own run files use). Reads, listings and
deletes are the local file system's own.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs

_UMASK = os.umask(0o022)
os.umask(_UMASK)  # read once: a file made whole gets the mode an open() would have given it
TMP_SUFFIX = ".raysys-whole.tmp"


def remove_leftovers(folder: str | Path) -> None:
    """The temporary files of writes a killed process left unfinished (never the files themselves)."""
    for tmp in Path(folder).rglob(f".*{TMP_SUFFIX}"):
        with contextlib.suppress(OSError):
            tmp.unlink()


def whole_files_fs() -> pafs.PyFileSystem:
    """A pyarrow file system for Tune's ``storage_filesystem``: the local one, with whole-file writes."""
    return pafs.PyFileSystem(WholeFilesHandler())


class _WholeFile:
    """A file object that writes to a temporary file beside ``path`` and renames it over ``path`` on a
    close after writes that all succeeded; after a failed write (a full disk) the close removes it."""

    def __init__(self, path: str):
        self.path, self.closed, self.failed = path, False, False
        fd, self.tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=f".{os.path.basename(path)}.",
                                        suffix=TMP_SUFFIX)
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp's file is private
        self.f = os.fdopen(fd, "wb")

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except BaseException:
            self.failed = True
            raise

    def flush(self) -> None:
        try:
            self.f.flush()
        except BaseException:
            self.failed = True
            raise

    def tell(self) -> int:
        return self.f.tell()

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False

    def __del__(self):  # dropped unclosed (pyarrow's copy failed): never made the file, never left behind
        if not self.closed:
            self.failed = True
            with contextlib.suppress(Exception):
                self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if not self.failed:
                self.f.flush()
                os.fsync(self.f.fileno())
            self.f.close()
            if self.failed:
                raise OSError(f"{self.path} was not written whole; the earlier copy is kept")
            os.replace(self.tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                self.f.close()
            with contextlib.suppress(OSError):
                os.unlink(self.tmp)
            raise


class WholeFilesHandler(pafs.FileSystemHandler):
    """pyarrow's ``LocalFileSystem`` with :class:`_WholeFile` output streams."""

    def __init__(self):
        self.fs = pafs.LocalFileSystem()

    def __eq__(self, other) -> bool:
        return isinstance(other, WholeFilesHandler)

    def __ne__(self, other) -> bool:
        return not self == other

    def __reduce__(self):  # Tune pickles its storage context into every trial's process
        return WholeFilesHandler, ()

    def get_type_name(self) -> str:
        return "raysys-whole-files"

    def normalize_path(self, path):
        return self.fs.normalize_path(path)

    def get_file_info(self, paths):
        return self.fs.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self.fs.get_file_info(selector)

    def create_dir(self, path, recursive):
        self.fs.create_dir(path, recursive=recursive)

    def delete_dir(self, path):
        self.fs.delete_dir(path)

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self.fs.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self):
        raise OSError("raysys: refusing to delete the contents of the root folder")

    def delete_file(self, path):
        self.fs.delete_file(path)

    def move(self, src, dest):
        self.fs.move(src, dest)

    def copy_file(self, src, dest):
        with self.fs.open_input_stream(src) as source, self.open_output_stream(dest, None) as target:
            while chunk := source.read(1 << 20):
                target.write(chunk)

    def open_input_stream(self, path):
        return self.fs.open_input_stream(path)

    def open_input_file(self, path):
        return self.fs.open_input_file(path)

    def open_output_stream(self, path, metadata):
        return pa.PythonFile(_WholeFile(path), mode="w")

    def open_append_stream(self, path, metadata):
        return self.fs.open_append_stream(path, metadata=metadata)
