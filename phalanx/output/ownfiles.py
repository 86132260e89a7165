"""Files phalanx reads or writes in directories other users may reach, checked first.

phalanx writes logs, reads agents' addresses and runs shipped code from directories the
user names (``log_dir``, ``SlurmBackend(state_dir=)``, ``phalanx agent --store``), and a
path such as ``/tmp/x`` may have been made first by another local user. Anyone who can
write to such a directory can plant a link at a file's name (and have the user's output
written over a file of the user's), a FIFO (and block the process that opens it), or a
file of their own (read as an agent's address, or run as the user's code). So:

- a directory whose contents are trusted is used only when it is a directory of ours that
  no one else can write to (:func:`private_dir`, :func:`check_private`): not a link, owned
  by this process's user, neither group- nor world-writable (a sticky bit does not help:
  others could still add names). phalanx creates a missing one, mode 0700;
- a file in it is opened without following a link (``O_NOFOLLOW``) and without blocking
  (``O_NONBLOCK``: a FIFO is refused, never waited on), then checked on the open
  descriptor (``fstat``): only a regular file of ours (:func:`open_regular`), so the file
  checked is the file used.

Only the directory itself is checked, not the directories above it (group-writable project
directories are common on clusters, and their members are the user's colleagues).

Every refusal is a ``ValueError`` naming the path and what was wrong with it (its owner,
its mode), ending with what phalanx will not do with it (the caller's ``why``).
"""

from __future__ import annotations

import errno
import os
import pwd
import stat

# what every open here adds: no link followed, no FIFO waited on, nothing inherited
SAFE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def user_name(uid: int) -> str:
    """``user alice (uid 1000)``, or ``uid 1000`` for a uid with no name."""
    try:
        return f"user {pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def owner_and_mode(info: os.stat_result) -> str:
    return f"owner {user_name(info.st_uid)}, mode {stat.S_IMODE(info.st_mode):04o}"


def check_owner(shown: str, info: os.stat_result, why: str) -> None:
    """ValueError unless what ``info`` describes (``shown``: how errors name it) belongs to
    this process's (effective) user."""
    uid = os.geteuid()
    if info.st_uid != uid:
        raise ValueError(f"{shown} belongs to {user_name(info.st_uid)}, not to you "
                         f"({user_name(uid)}), mode {stat.S_IMODE(info.st_mode):04o}: {why}")


def check_private(shown: str, info: os.stat_result, why: str) -> None:
    """ValueError unless ``info`` is of a directory (or file) of ours that neither its group
    nor anyone else may write to."""
    check_owner(shown, info, why)
    if info.st_mode & 0o022:
        who = "everyone" if info.st_mode & 0o002 else "its group"
        raise ValueError(f"{shown} can be written by {who} ({owner_and_mode(info)}): "
                         f"someone else could plant links or files in it; {why}")


def private_dir(path: str | os.PathLike[str], shown: str, why: str,
                create: bool = True) -> os.stat_result:
    """Check that ``path`` is a directory of ours no one else can write to (creating it,
    mode 0700, with its missing parents, if ``create`` and it is absent) -> its ``lstat``.
    ValueError naming ``shown``, and ending with ``why``, when it is a link, not a
    directory, another user's, group- or world-writable, or cannot be made."""
    if create:
        try:
            os.makedirs(path, mode=0o700)
        except FileExistsError:
            pass  # checked below, whatever it is
        except OSError as exc:
            raise ValueError(f"{shown} cannot be created: {exc.strerror or exc}") from None
    try:
        info = os.lstat(path)
    except OSError as exc:
        raise ValueError(f"{shown} cannot be used: {exc.strerror or exc}") from None
    if stat.S_ISLNK(info.st_mode):
        raise ValueError(f"{shown} is a symbolic link (owner {user_name(info.st_uid)}), "
                         f"not followed: {why}")
    if not stat.S_ISDIR(info.st_mode):
        raise ValueError(f"{shown} is not a directory ({owner_and_mode(info)}): {why}")
    check_private(shown, info, why)
    return info


def open_regular(path: str | os.PathLike[str], flags: int, shown: str, *, mode: int = 0o600,
                 dir_fd: int | None = None,
                 why: str = "phalanx uses only a file of yours there") -> int:
    """``os.open(path, flags)`` (``mode`` for a file it creates; ``dir_fd``: relative to
    that directory), never through a link and never blocking, and only for a regular file
    of ours -> the descriptor, set blocking again. ValueError naming ``shown`` for a link, a
    FIFO, a socket or device, a directory, or another user's file (a link's target is left
    alone; ``why`` ends the refusal of another user's); any other failure of the open (the
    file is absent, ...) is its ``OSError``."""
    try:
        fd = os.open(path, flags | SAFE_FLAGS, mode, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ValueError(f"{shown} is a symbolic link: not followed, and its target "
                             "left alone") from None
        if exc.errno == errno.ENXIO:  # O_NONBLOCK's answer for a FIFO without a reader
            raise ValueError(f"{shown} is not a regular file (a FIFO or a socket): "
                             "refused rather than waited on") from None
        if exc.errno == errno.EEXIST and flags & os.O_EXCL:  # to be made new: put there
            try:
                info = os.lstat(path, dir_fd=dir_fd)
                found = ("a symbolic link" if stat.S_ISLNK(info.st_mode) else
                         "a regular file" if stat.S_ISREG(info.st_mode) else
                         _kind(info.st_mode))
                found += f", {owner_and_mode(info)}"
            except OSError:
                found = "gone again"
            raise ValueError(f"{shown} exists already ({found}): phalanx makes it new, "
                             "and will not write to one put there (nor follow a link)"
                             ) from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{shown} is not a regular file ({_kind(info.st_mode)}, "
                             f"{owner_and_mode(info)})")
        check_owner(shown, info, why)
        os.set_blocking(fd, True)
        return fd
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike[str], shown: str, limit: int,
                 last: bool = False) -> bytes:
    """At most ``limit`` bytes of a regular file of ours (:func:`open_regular`): its first,
    or with ``last`` its last. ValueError as open_regular's; OSError when it cannot be
    read (absent, ...)."""
    fd = open_regular(path, os.O_RDONLY, shown)
    with os.fdopen(fd, "rb") as f:
        if last:
            f.seek(max(0, os.fstat(fd).st_size - limit))
        return f.read(limit)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a file"
