"""The cluster's shared token: where each side reads it, and how long it must be.

The controller (:class:`~phalanx.backends.cluster.backend.ClusterBackend`'s ``token=``,
``token_file=`` or ``$PHALANX_TOKEN``) and every agent (``phalanx agent --token-file`` or
``$PHALANX_TOKEN``) hold the same secret; the handshake (:mod:`phalanx.wire.handshake`)
proves it both ways. Both sides read it with these rules, so they refuse the same tokens.

A token file is refused, as ssh refuses a private key, unless only its owner can read or
write it (no group or other bits: ``chmod 600 FILE``) and that owner is this user (or root,
who can read anything anyway): a file others can read gives the token away, and a file
another user owns can be replaced by them with a token of their choosing.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping

from phalanx import config

TOKEN_ENV = config.ENV_TOKEN
MIN_TOKEN = 16  # bytes: a shorter shared secret is refused


def new_token() -> str:
    """A fresh token: 256 random bits, as 43 URL-safe characters (``phalanx token``)."""
    import secrets

    return secrets.token_urlsafe(32)


def write_token_file(path: str) -> str:
    """Write a fresh token to ``path``, a new file only this user can read (0600); the
    token. ValueError, naming it, when the file exists (a token is never overwritten)."""
    token = new_token()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
    except FileExistsError:
        raise ValueError(f"{path} exists: a token file is never overwritten (remove it "
                         "first, or give another path)") from None
    except OSError as exc:
        raise ValueError(f"cannot create the token file {path}: {exc.strerror or exc}") from None
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def read_token(token_file: str | None, environ: Mapping[str, str] | None = None) -> bytes:
    """The shared token: from ``token_file``, else ``$PHALANX_TOKEN``; ValueError if there
    is none or it is too short to be a secret."""
    env = os.environ if environ is None else environ
    if token_file is not None:
        token = _read_private(token_file)
        where = f"the token file {token_file}"
    elif env.get(TOKEN_ENV):
        token, where = env[TOKEN_ENV].strip().encode(), f"${TOKEN_ENV}"
    else:
        raise ValueError(f"a token is required: --token-file FILE or ${TOKEN_ENV} (the same "
                         "secret the controller uses)")
    if len(token) < MIN_TOKEN:
        raise ValueError(f"{where} holds {len(token)} bytes; a token needs at least "
                         f"{MIN_TOKEN} (make one with: phalanx token --file FILE)")
    return token


def _read_private(token_file: str) -> bytes:
    """The token file's contents, once it is known to be private (see the module docstring).
    The checks are made on the open descriptor, so the file read is the file checked
    (and a FIFO put in its place cannot block the open)."""
    try:
        fd = os.open(token_file, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as exc:
        raise ValueError(f"cannot read the token file {token_file}: "
                         f"{exc.strerror or exc}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        check_private(token_file, info.st_mode, info.st_uid)
        try:
            return f.read().strip()
        except OSError as exc:
            raise ValueError(f"cannot read the token file {token_file}: "
                             f"{exc.strerror or exc}") from None


def check_private(token_file: str, mode: int, owner: int, uid: int | None = None) -> None:
    """ValueError, naming the fix, unless a file of ``mode`` owned by ``owner`` is private to
    user ``uid`` (this process's user by default)."""
    uid = os.getuid() if uid is None else uid
    if owner not in (uid, 0):
        raise ValueError(f"the token file {token_file} belongs to user {owner}, not to this "
                         f"user ({uid}): another user could change it: copy it to a file "
                         f"of your own, then chmod 600 that file")
    if not stat.S_ISREG(mode):
        raise ValueError(f"the token file {token_file} is not a regular file")
    if stat.S_IMODE(mode) & 0o077:
        who = []
        for name, shift in (("its group", 3), ("others", 0)):
            bits = (mode >> shift) & 0o7
            verbs = [verb for verb, bit in (("read", 4), ("write", 2), ("run", 1)) if bits & bit]
            if verbs:
                who.append(f"{name} can {' and '.join(verbs)} it")
        raise ValueError(f"the token file {token_file} has mode {stat.S_IMODE(mode):04o}: "
                         f"{'; '.join(who)}. A token file must be private to its owner: "
                         f"chmod 600 {token_file}")


def exec_without_token(argv: list[str], environ: Mapping[str, str] | None = None) -> None:
    """Run ``argv`` (a ``phalanx`` command line) again in this process, with
    ``$PHALANX_TOKEN`` handed over on a pipe (``--token-fd N``) instead of in the
    environment: removing a variable from ``os.environ`` leaves it in the block the kernel
    shows as ``/proc/<pid>/environ``; a new program's block is its own. Returns only if
    there is no such variable."""
    env = dict(os.environ if environ is None else environ)
    token = env.pop(TOKEN_ENV, None)
    if token is None:
        return
    import sys

    read, write = os.pipe()
    try:
        os.write(write, token.encode())  # far under a pipe's buffer: never blocks
    finally:
        os.close(write)
    os.set_inheritable(read, True)
    os.execve(sys.executable, [sys.executable, "-m", "phalanx", *argv,
                               "--token-fd", str(read)], env)


def token_from_fd(fd: int) -> bytes:
    """The token handed over on descriptor ``fd`` (:func:`exec_without_token`), which is
    closed; ValueError if it is too short."""
    with os.fdopen(fd, "rb") as f:
        token = f.read(1 << 16).strip()
    if len(token) < MIN_TOKEN:
        raise ValueError(f"${TOKEN_ENV} holds {len(token)} bytes; a token needs at least "
                         f"{MIN_TOKEN} (make one with: phalanx token --file FILE)")
    return token


def given_token(token: str | bytes) -> bytes:
    """A token given as a value (``ClusterBackend(token=...)``), as bytes; ValueError if it
    is too short to be the agents' token."""
    secret = (token.encode() if isinstance(token, str) else bytes(token)).strip()
    if len(secret) < MIN_TOKEN:
        raise ValueError(f"token= holds {len(secret)} bytes; the agents' token has "
                         f"at least {MIN_TOKEN}")
    return secret
