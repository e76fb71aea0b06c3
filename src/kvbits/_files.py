"""File helpers shared by the stages that write files others read (calibration artifacts, metrics)."""

from __future__ import annotations

import os


def chmod_default(path: str | os.PathLike[str]) -> None:
    """Give ``path`` the permissions of a normally created file (``0666 & ~umask``): ``tempfile.mkstemp``
    creates its files 0600, which a reader running as another user (node_exporter, a server) can not open."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
