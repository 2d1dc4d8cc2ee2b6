"""A hash of this package's Python sources: part of every cache key whose entry depends on what our code does
(the pre-grad pass's uuid, the AOTAutograd cache key of graphs that call the graph prologue)."""
from __future__ import annotations

import functools
import hashlib
import os


@functools.lru_cache(maxsize=None)
def package_hash() -> str:
    """sha256 of every ``.py`` file under ``sage_compile/`` (path order), hex."""
    h = hashlib.sha256()
    root = os.path.dirname(__file__)
    for dirpath, dirs, files in os.walk(root):
        dirs.sort()
        for f in sorted(files):
            if f.endswith(".py"):
                with open(os.path.join(dirpath, f), "rb") as fh:
                    h.update(os.path.relpath(os.path.join(dirpath, f), root).encode())
                    h.update(fh.read())
    return h.hexdigest()
