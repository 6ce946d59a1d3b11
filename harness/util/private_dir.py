"""A cache folder that only its owner can write (for caches that hold code, such as XLA's compiled programs).

Whoever can write a compile cache can put code there that the next run loads and executes. So the folder is
created with mode 0700, an existing folder of this user that others can only read is made 0700, and one that
is not owned by this user, or that group or others can write, is refused with the reason (the caller then
runs without the cache).
"""
from __future__ import annotations

import os
import stat


def private_dir(path: str) -> tuple[str | None, str | None]:
    """(path, None) when ``path`` is, or has just been made, a folder only this user can write; else (None, why)."""
    path = os.path.abspath(os.path.expanduser(path))
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        return None, f"cannot create {path}: {exc.strerror}"
    try:
        info = os.stat(path, follow_symlinks=False)
    except OSError as exc:
        return None, f"cannot read {path}: {exc.strerror}"
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        return None, f"{path} is not a folder (a link or a file)"
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        return None, f"{path} belongs to another user (uid {info.st_uid})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return None, (f"{path} can be written by other users (mode {stat.S_IMODE(info.st_mode):o}); they could "
                      f"place code there that this run would execute: chmod 700 {path}")
    if stat.S_IMODE(info.st_mode) & 0o077:
        try:
            os.chmod(path, 0o700)
        except OSError as exc:
            return None, f"cannot make {path} private (chmod 700): {exc.strerror}"
    return path, None
