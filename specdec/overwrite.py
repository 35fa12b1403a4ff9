"""Which folders a command may replace, and replacing one in a single swap.

A command that replaces its output folder (`specdec publish`'s `--out`, the data stage's `output_dir` with
overwrite=true, the trainer's `output_dir`) calls `check_replaceable(path, markers, name)` first: it may replace
only a folder that is empty or holds one of `markers`, the file that command writes into every folder it makes
(publish: specdec_publish.json; the data stage: manifest.json). And never, marker or not, the home folder, the
current folder, or any folder above either (the filesystem root included), symlinks resolved: a wrong `--out ~`
or `--out .` must not delete a home folder or a checkout.

The new folder is written into `temp_sibling(path)` (beside it, so on the same filesystem) and put in place by
`replace_folder_atomically(tmp, path)`: the old folder is renamed aside, the new one renamed in, and the old one
deleted only then. On any failure the temporary folder is deleted and the old folder is back where it was.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Sequence
from pathlib import Path


def _resolved(path: str | os.PathLike) -> Path:
    return Path(path).expanduser().resolve()


def _protected(folder: Path) -> str | None:
    """Why `folder` (resolved) may never be replaced, or None."""
    try:
        home = Path.home()
    except RuntimeError:  # no $HOME and no password entry: only the current folder to guard
        home = Path.cwd()
    for base, label in ((home, "your home folder"), (Path.cwd(), "the current folder")):
        base = base.resolve()
        if folder == base:
            return label
        if folder in base.parents:
            return "the filesystem root" if folder == Path(folder.anchor) else f"a folder above {label}"
    return None


def check_replaceable(path: str | os.PathLike, markers: Sequence[str], name: str = "the folder") -> None:
    """A ValueError (one line: the folder, why, what to do) unless `path` may be replaced by a new folder.

    It may be when it does not exist, or is a folder that is empty or holds one of `markers` (files this command
    writes into its own folders), and is neither the home folder, the current folder nor a folder above either.
    `name` is how the user named the setting (`--out`, `output_dir`), for the message."""
    given = Path(path).expanduser()
    if not given.exists() and not given.is_symlink():
        return
    folder = _resolved(given)
    why = _protected(folder)
    if why is not None:
        raise ValueError(f"{name} {path} is {why} ({folder}); specdec never replaces it: choose a new folder "
                         f"(e.g. runs/NAME) for {name}")
    if not folder.is_dir():
        raise ValueError(f"{name} {path} exists and is not a folder; choose a new folder for {name}")
    if any(folder.iterdir()) and not any((folder / marker).is_file() for marker in markers):
        raise ValueError(f"{name} {path} holds files specdec did not write (it has no {' or '.join(markers)}); "
                         f"specdec replaces only an empty folder or one it made: choose a new folder for {name}, "
                         "or empty this one yourself")


def temp_sibling(path: str | os.PathLike, kind: str = "tmp") -> Path:
    """A new, empty, hidden folder beside `path` (`.NAME.tmp-RANDOM`), on the same filesystem so that a rename
    moves it into place. Created with the umask's mode, as any folder (not tempfile's 0700)."""
    dst = _resolved(path)
    while True:
        tmp = dst.parent / f".{dst.name}.{kind}-{secrets.token_hex(4)}"
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp.mkdir()
            return tmp
        except FileExistsError:
            continue
        except OSError as err:
            raise ValueError(f"could not create a folder beside {dst} ({err}); check that {dst.parent} is a "
                             "writable folder, or choose another place") from err


def _unused_sibling(dst: Path, kind: str) -> Path:
    while (candidate := dst.parent / f".{dst.name}.{kind}-{secrets.token_hex(4)}").exists():
        pass
    return candidate


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def replace_folder_atomically(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """Put the finished folder `tmp` (from `temp_sibling(path)`) in `path`'s place; the old folder is deleted
    only once the new one is there. On any failure (or interrupt) `tmp` is deleted and the old folder is as it
    was. Call `check_replaceable` first: this replaces whatever `path` is."""
    tmp, dst = Path(tmp), _resolved(path)
    old = None
    try:
        if dst.exists() or dst.is_symlink():
            old = _unused_sibling(dst, "old")
            os.rename(dst, old)
        os.rename(tmp, dst)
    except BaseException as err:
        if old is not None and old.exists() and not dst.exists():
            os.rename(old, dst)  # the old folder back in its place
            old = None
        _remove(tmp)
        if isinstance(err, OSError):
            raise ValueError(f"could not put the new folder in place of {dst} ({err}); nothing changed there: "
                             "check the permissions of its parent folder, then retry") from err
        raise
    if old is not None:
        _remove(old)


def set_modes(folder: str | os.PathLike, dir_mode: int = 0o755, file_mode: int = 0o644) -> None:
    """Give `folder`, its subfolders and files the modes any shared model folder has (readable by all, written
    by the owner), whatever the umask or the temporary folder's own mode was. Symlinks are left alone."""
    root = Path(folder)
    for here, dirs, files in os.walk(root):
        for name in files:
            if not (Path(here) / name).is_symlink():
                os.chmod(Path(here) / name, file_mode)
        for name in dirs:
            if not (Path(here) / name).is_symlink():
                os.chmod(Path(here) / name, dir_mode)
    os.chmod(root, dir_mode)
