"""Shipping the controller's code to the nodes, content-addressed (``ClusterBackend(sync=)``).

The controller scans a directory (:func:`scan`): every file's SHA-256, its mode and its
path under the directory, and from those a *version* -- the hash of the whole listing. A
node keeps a :class:`Store`: each file once, by its hash (``blobs/``), and each version as
a directory tree assembled from them (``trees/<version>/``). The controller sends only the
files whose hashes the node lacks, so a tree sent before is not sent again, and a change to
one file sends that file. Ranks run in the tree (their cwd, first on ``sys.path``) with
``PHALANX_CODE_VERSION`` set to its version, which ``health()`` reports.

Scanning skips what is not code: version-control and tool directories, virtual
environments, caches and compiled files (:data:`SKIPPED_DIRS`, :data:`SKIPPED_SUFFIXES`).
A node checks every path it is sent (relative, inside the tree) and every file against its
hash before keeping it.

What a node runs is the user's code only if no one else could have put it there. The store
(``phalanx agent --store DIR``) is used only when ``DIR`` and its ``blobs/`` and ``trees/``
are directories of the agent's user that no one else can write to (created 0700; another
user's, a group- or world-writable one, or a link, is refused naming its owner and mode:
:mod:`phalanx.output.ownfiles`), checked as the agent starts and again at each use. A blob is
never trusted by its name: :meth:`Store.missing` hashes every blob it counts as held (one
that does not match, or is not a regular file of ours, is removed and so sent again), and
:meth:`Store.build` hashes each again as it copies it into a tree, refusing, naming the
file, one that does not match. Blobs and trees are opened without following links.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path, PurePosixPath
from typing import BinaryIO

from phalanx.output import ownfiles

logger = logging.getLogger(__name__)

ENV_VERSION = "PHALANX_CODE_VERSION"
SKIPPED_DIRS = frozenset({".git", ".hg", ".svn", "__pycache__", ".venv", "venv", ".tox",
                          ".nox", ".mypy_cache", ".pytest_cache", ".ruff_cache",
                          ".hypothesis", "node_modules", ".ipynb_checkpoints"})
SKIPPED_SUFFIXES = (".pyc", ".pyo", ".egg-info")
MAX_TREE = 512 << 20  # bytes: a larger tree is data, not code (ship it otherwise)

Entry = tuple[str, str, int, int]  # relative path, sha256, mode, size


def scan(root: str | os.PathLike[str], max_bytes: int = MAX_TREE) -> tuple[str, list[Entry]]:
    """``(version, listing)`` of the code under ``root``; ValueError if it is not a
    directory, or holds more than ``max_bytes``."""
    base = Path(root).resolve()
    if not base.is_dir():
        raise ValueError(f"sync={str(root)!r} is not a directory")
    listing: list[Entry] = []
    total = 0
    for directory, dirs, files in os.walk(base):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS
                         and not d.endswith(SKIPPED_SUFFIXES))
        for name in sorted(files):
            if name.endswith(SKIPPED_SUFFIXES):
                continue
            path = Path(directory, name)
            info = path.lstat()
            if not stat.S_ISREG(info.st_mode):
                continue  # links and special files are not shipped
            total += info.st_size
            if total > max_bytes:
                raise ValueError(f"sync={str(root)!r} holds more than {max_bytes} bytes "
                                 f"({max_bytes / (1 << 20):g} MiB); ship a package "
                                 "directory, not data")
            listing.append((path.relative_to(base).as_posix(), _hash_file(path),
                            stat.S_IMODE(info.st_mode), info.st_size))
    return version_of(listing), listing


def version_of(listing: Sequence[Entry]) -> str:
    """The version of a listing: a hash of every path, content hash and mode, in order."""
    text = json.dumps([[p, h, m] for p, h, m, _ in sorted(listing)], separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _hash_file(path: Path) -> str:
    with open(path, "rb") as f:
        return _hash_of(f)


def _hash_of(source: BinaryIO, copy: BinaryIO | None = None) -> str:
    """The SHA-256 of what is left to read of ``source``, written to ``copy`` on the way."""
    digest = hashlib.sha256()
    for chunk in iter(lambda: source.read(1 << 20), b""):
        digest.update(chunk)
        if copy is not None:
            copy.write(chunk)
    return digest.hexdigest()


def read_blobs(root: str | os.PathLike[str], listing: Sequence[Entry],
               wanted: Iterable[str]) -> list[tuple[str, bytes]]:
    """The contents of the files whose hashes are ``wanted`` (each once)."""
    by_hash = {h: p for p, h, _, _ in listing}
    return [(h, (Path(root) / by_hash[h]).read_bytes()) for h in dict.fromkeys(wanted)]


def check_path(relative: str) -> PurePosixPath:
    """A listing's path, refused if it could leave the tree."""
    path = PurePosixPath(relative)
    if path.is_absolute() or not path.parts or any(p in ("..", "") for p in path.parts):
        raise ValueError(f"refused to write outside the code tree: {relative!r}")
    return path


class Store:
    """A node's code: blobs by hash, trees by version, under ``root`` (see the module
    docstring: a directory of ours no one else can write to; what is run from it is
    checked against its hash)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.blobs = self.root / "blobs"
        self.trees = self.root / "trees"
        for directory in (self.root, self.blobs, self.trees):
            ownfiles.private_dir(directory, *self._refusal(directory))  # made 0700 if absent

    def _refusal(self, directory: Path) -> tuple[str, str]:
        """How errors name ``directory`` of the store, and why it is refused."""
        shown = "code store" if directory == self.root else f"code store's {directory.name}/"
        return f"{shown} {str(directory)!r}", (
            "phalanx will not run code kept in it: give phalanx agent --store a directory of "
            "your own that only you can write to (chmod 700 it), or a path that does not "
            "exist yet (phalanx creates it, mode 0700)")

    def _check(self) -> None:
        """The store's directories are still ours and private (a path may be swapped)."""
        for directory in (self.root, self.blobs, self.trees):
            ownfiles.private_dir(directory, *self._refusal(directory), create=False)

    def tree(self, version: str) -> Path | None:
        """The tree of ``version`` if this node holds it: a directory of ours (a link or
        anything else there is not taken)."""
        self._check()
        path = self.trees / _safe_version(version)
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            return None
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            raise ValueError(f"code tree {str(path)!r} is not a directory of yours "
                             f"({ownfiles.owner_and_mode(info)}): phalanx will not run "
                             "code from it; remove it")
        return path

    def missing(self, listing: Sequence[Entry]) -> list[str]:
        """The hashes of the listing's files this node does not hold. A file held under a
        hash is hashed again: one whose contents do not match (or that is not a regular
        file of ours) is removed, and counted missing, so that it is sent again."""
        self._check()
        return [h for h in dict.fromkeys(h for _, h, _, _ in listing) if not self._holds(h)]

    def _holds(self, digest: str) -> bool:
        path = self.blobs / _safe_hash(digest)
        shown = f"code blob {str(path)!r}"
        try:
            fd = ownfiles.open_regular(path, os.O_RDONLY, shown)
        except FileNotFoundError:
            return False
        except (OSError, ValueError) as exc:
            self._discard(path, str(exc))
            return False
        with os.fdopen(fd, "rb") as f:
            if _hash_of(f) == digest:
                return True
        self._discard(path, f"{shown} does not match its hash")
        return False

    def _discard(self, path: Path, why: str) -> None:
        logger.warning("%s: removed, to be sent again", why)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:  # a directory there: build() refuses it, naming it
            logger.warning("cannot remove %s: %s", path, exc.strerror or exc)

    def put(self, digest: str, data: bytes) -> None:
        """Keep a file's contents, once checked against its hash."""
        name = _safe_hash(digest)
        if hashlib.sha256(data).hexdigest() != digest:
            raise ValueError(f"a file sent as {digest[:12]}... does not match its hash")
        self._check()
        fd, temporary = tempfile.mkstemp(dir=self.blobs, prefix=".incoming-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(temporary, self.blobs / name)

    def build(self, version: str, listing: Sequence[Entry]) -> Path:
        """The tree of ``version`` (assembled from the blobs if it is new). Each blob is
        hashed again as it is copied: one that does not match is removed, and the build
        refused with a ValueError naming it (the next sync sends it again)."""
        if version_of(listing) != version:
            raise ValueError("the listing does not match its version")
        existing = self.tree(version)
        if existing is not None:
            return existing
        import shutil

        staging = Path(tempfile.mkdtemp(dir=self.trees, prefix=".building-"))
        try:
            for relative, digest, mode, _ in listing:
                target = staging / check_path(relative)
                target.parent.mkdir(parents=True, exist_ok=True)
                self._copy(relative, digest, target)
                os.chmod(target, mode & 0o755 | 0o600)
            os.rename(staging, self.trees / version)
        except OSError:
            if self.tree(version) is None:  # not another agent on this machine building it
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return self.trees / version

    def _copy(self, relative: str, digest: str, target: Path) -> None:
        """Blob ``digest`` to ``target`` (a new file), checked against its hash on the way."""
        source = self.blobs / _safe_hash(digest)
        shown = f"code blob {str(source)!r} (for {relative})"
        try:
            fd = ownfiles.open_regular(source, os.O_RDONLY, shown)
        except FileNotFoundError:
            raise ValueError(f"{relative} was not sent") from None
        except ValueError as exc:
            self._discard(source, str(exc))
            raise ValueError(f"{exc}: removed; the next sync sends it again") from None
        created = ownfiles.open_regular(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL,
                                        f"{relative} in the tree being built")
        with os.fdopen(fd, "rb") as src, os.fdopen(created, "wb") as dst:
            found = _hash_of(src, dst)
        if found != digest:
            self._discard(source, f"{shown} does not match its hash")
            raise ValueError(f"{shown} does not match its hash (its contents hash to "
                             f"{found[:12]}..., not {digest[:12]}...): phalanx will not run "
                             "it; it was removed, and the next sync sends it again")


def _safe_hash(digest: str) -> str:
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise ValueError(f"not a SHA-256 hash: {digest[:70]!r}")
    return digest


def _safe_version(version: str) -> str:
    """A version as :func:`version_of` makes them: a tree's name, never a path."""
    if len(version) != 32 or any(c not in "0123456789abcdef" for c in version):
        raise ValueError(f"not a code version: {version[:40]!r}")
    return version


def default_store() -> Path:
    """Where an agent keeps shipped code: ``$XDG_CACHE_HOME/phalanx/agent`` (or
    ``~/.cache/...``)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "phalanx" / "agent"
