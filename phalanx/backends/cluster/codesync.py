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
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path, PurePosixPath

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
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
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
    """A node's code: blobs by hash, trees by version, under ``root``."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.blobs = self.root / "blobs"
        self.trees = self.root / "trees"
        for directory in (self.blobs, self.trees):
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)

    def tree(self, version: str) -> Path | None:
        path = self.trees / version
        return path if path.is_dir() else None

    def missing(self, listing: Sequence[Entry]) -> list[str]:
        """The hashes of the listing's files this node does not hold."""
        return [h for h in dict.fromkeys(h for _, h, _, _ in listing)
                if not (self.blobs / _safe_hash(h)).is_file()]

    def put(self, digest: str, data: bytes) -> None:
        """Keep a file's contents, once checked against its hash."""
        name = _safe_hash(digest)
        if hashlib.sha256(data).hexdigest() != digest:
            raise ValueError(f"a file sent as {digest[:12]}... does not match its hash")
        fd, temporary = tempfile.mkstemp(dir=self.blobs, prefix=".incoming-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(temporary, self.blobs / name)

    def build(self, version: str, listing: Sequence[Entry]) -> Path:
        """The tree of ``version`` (assembled from the blobs if it is new)."""
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
                source = self.blobs / _safe_hash(digest)
                if not source.is_file():
                    raise ValueError(f"{relative} was not sent")
                with open(source, "rb") as src, open(target, "wb") as dst:
                    dst.write(src.read())
                os.chmod(target, mode & 0o755 | 0o600)
            os.rename(staging, self.trees / version)
        except OSError:
            if self.tree(version) is None:  # not another agent on this machine building it
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return self.trees / version


def _safe_hash(digest: str) -> str:
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise ValueError(f"not a SHA-256 hash: {digest[:70]!r}")
    return digest


def default_store() -> Path:
    """Where an agent keeps shipped code: ``$XDG_CACHE_HOME/phalanx/agent`` (or
    ``~/.cache/...``)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "phalanx" / "agent"
