"""Content-addressed code shipping, without agents (``phalanx.backends.cluster.codesync``):
what a scan lists and skips, when the version changes, and what a node's :class:`Store` accepts,
refuses and builds."""

from __future__ import annotations

import hashlib
import os
import random
import stat
import tempfile
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from phalanx.backends.cluster import codesync
from phalanx.backends.cluster.codesync import Store, check_path, read_blobs, scan, version_of

MIB = 1 << 20


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write(root: Path, relative: str, data: bytes | str, mode: int = 0o644) -> Path:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    path.chmod(mode)
    return path


def scanned(root: Path) -> tuple[str, list]:
    """``scan``, its listing sorted (a scan lists a directory's files before its
    subdirectories')."""
    version, listing = scan(root)
    return version, sorted(listing)


def everything_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def filled_store(root: Path, files: dict[str, tuple[bytes, int]]) -> tuple[Store, str, list]:
    """A store holding the blobs of ``files`` (path -> (contents, mode)), and the listing's
    version and listing."""
    store = Store(root)
    listing = []
    for relative, (data, mode) in files.items():
        store.put(sha(data), data)
        listing.append((relative, sha(data), mode, len(data)))
    return store, version_of(listing), listing


@pytest.fixture
def code(tmp_path) -> Path:
    root = tmp_path / "code"
    write(root, "pkg/__init__.py", "")
    write(root, "pkg/mod.py", "def value():\n    return 1\n")
    write(root, "run.sh", "#!/bin/sh\necho hi\n", mode=0o755)
    return root


# --------------------------------------------------------------------------- scan


def test_scan_lists_regular_files_with_hash_mode_and_size(code):
    version, listing = scanned(code)
    assert listing == [
        ("pkg/__init__.py", sha(b""), 0o644, 0),
        ("pkg/mod.py", sha(b"def value():\n    return 1\n"), 0o644, 26),
        ("run.sh", sha(b"#!/bin/sh\necho hi\n"), 0o755, 18),
    ]
    assert version == version_of(listing)
    assert len(version) == 32 and all(c in "0123456789abcdef" for c in version)


def test_scan_skips_tool_directories_compiled_files_egg_info_and_links(code, tmp_path):
    before = scan(code)
    write(code, ".git/HEAD", "ref: refs/heads/main\n")
    write(code, "pkg/.git/config", "[core]\n")
    write(code, "pkg/__pycache__/mod.cpython-311.pyc", b"\x00compiled")
    write(code, ".venv/lib/site.py", "x = 1\n")
    write(code, "pkg/stale.pyc", b"\x00compiled")
    write(code, "pkg/stale.pyo", b"\x00compiled")
    write(code, "pkg.egg-info/PKG-INFO", "Name: pkg\n")
    write(code, "odd.egg-info", "a file so named\n")
    outside = write(tmp_path, "outside/secret.py", "SECRET = 1\n")
    (code / "pkg" / "linked.py").symlink_to(code / "pkg" / "mod.py")
    (code / "secret.py").symlink_to(outside)
    (code / "linkdir").symlink_to(outside.parent, target_is_directory=True)
    (code / "dangling.py").symlink_to(tmp_path / "nowhere")
    os.mkfifo(code / "pipe")
    assert scan(code) == before


def test_scan_of_a_directory_reached_through_a_link_lists_its_files(code, tmp_path):
    link = tmp_path / "via-link"
    link.symlink_to(code, target_is_directory=True)
    assert scan(link) == scan(code)


@pytest.mark.parametrize("change", ["content", "name", "mode", "new file", "removed file",
                                    "new directory"])
def test_the_version_changes_with_a_files_content_name_or_mode(code, change):
    version, _ = scan(code)
    mod = code / "pkg" / "mod.py"
    if change == "content":
        mod.write_text("def value():\n    return 2\n")  # same size
    elif change == "name":
        mod.rename(code / "pkg" / "mod2.py")
    elif change == "mode":
        mod.chmod(0o755)
    elif change == "new file":
        write(code, "pkg/extra.py", "")
    elif change == "removed file":
        (code / "pkg" / "__init__.py").unlink()
    else:
        write(code, "sub/pkg/mod.py", "def value():\n    return 1\n")
    assert scan(code)[0] != version


def test_the_version_does_not_change_with_mtime_or_a_rewrite_or_the_trees_location(
        code, tmp_path):
    version, listing = scan(code)
    for path in code.rglob("*"):
        os.utime(path, (1_000_000, 1_000_000))
    assert scan(code) == (version, listing)
    mod = code / "pkg" / "mod.py"
    mod.write_bytes(mod.read_bytes())
    assert scan(code) == (version, listing)
    moved = tmp_path / "elsewhere" / "code"
    moved.parent.mkdir()
    code.rename(moved)
    assert scan(moved) == (version, listing)


def test_a_tree_over_max_bytes_is_refused_naming_it_and_the_limit(tmp_path):
    root = tmp_path / "data"
    write(root, "a.bin", b"a" * MIB)
    assert scan(root, max_bytes=MIB)[1][0][3] == MIB  # exactly the limit is fine
    write(root, "b.bin", b"b")
    with pytest.raises(ValueError, match=r"more than 1048576 bytes \(1 MiB\)") as info:
        scan(root, max_bytes=MIB)
    assert str(root) in str(info.value)
    assert scan(root, max_bytes=2 * MIB)[0]


def test_skipped_files_do_not_count_against_max_bytes(tmp_path):
    root = tmp_path / "code"
    write(root, "mod.py", "x = 1\n")
    write(root, ".venv/big.bin", b"v" * (2 * MIB))
    write(root, "mod.pyc", b"c" * (2 * MIB))
    assert [p for p, *_ in scan(root, max_bytes=MIB)[1]] == ["mod.py"]


def test_not_a_directory_is_refused_naming_it(tmp_path):
    file = write(tmp_path, "file.py", "x = 1\n")
    for path in (file, tmp_path / "absent"):
        with pytest.raises(ValueError, match="is not a directory") as info:
            scan(path)
        assert str(path) in str(info.value)


def test_an_empty_directory_has_a_version(tmp_path):
    version, listing = scan(tmp_path)
    assert listing == [] and version == version_of([])


# --------------------------------------------------------------------------- version_of

entries = st.lists(
    st.tuples(st.text("abc/._-", min_size=1, max_size=8),
              st.binary(max_size=8).map(sha),
              st.sampled_from([0o644, 0o755, 0o600, 0o444]),
              st.integers(0, 1 << 30)),
    max_size=8, unique_by=lambda e: e[0])


@given(entries, st.randoms(use_true_random=False))
def test_the_version_is_stable_under_reordering_and_ignores_sizes(listing, rnd):
    shuffled = list(listing)
    rnd.shuffle(shuffled)
    assert version_of(shuffled) == version_of(listing)
    resized = [(p, h, m, s + 1) for p, h, m, s in listing]
    assert version_of(resized) == version_of(listing)


@given(entries.filter(bool), st.data())
def test_the_version_changes_with_any_path_hash_or_mode(listing, data):
    index = data.draw(st.integers(0, len(listing) - 1))
    path, digest, mode, size = listing[index]
    field = data.draw(st.sampled_from(["path", "hash", "mode"]))
    if field == "path":
        changed = (path + "x", digest, mode, size)
    elif field == "hash":
        changed = (path, sha(digest.encode()), mode, size)
    else:
        changed = (path, digest, mode ^ 0o100, size)
    altered = [*listing[:index], changed, *listing[index + 1:]]
    assert version_of(altered) != version_of(listing)


tree_files = st.dictionaries(
    st.lists(st.text("abcxyz_", min_size=1, max_size=5), min_size=1, max_size=3)
    .map(lambda parts: "/".join(parts) + ".py"),
    st.tuples(st.binary(max_size=64), st.sampled_from([0o644, 0o755])),
    max_size=6)


@settings(max_examples=40, deadline=None)
@given(tree_files)
def test_scan_and_build_round_trip_any_tree(files):
    # Two names where one is the other's directory ("a.py" and "a.py/b.py") cannot both be
    # files; keep the trees writable.
    names = set(files)
    files = {n: v for n, v in files.items()
             if not any(other.startswith(n + "/") for other in names)}
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch) / "code"
        root.mkdir()
        for relative, (data, mode) in files.items():
            write(root, relative, data, mode)
        version, listing = scan(root)
        assert sorted(listing) == sorted(
            (p, sha(d), m, len(d)) for p, (d, m) in files.items())
        store = Store(Path(scratch) / "store")
        assert set(store.missing(listing)) == {sha(d) for d, _ in files.values()}
        for digest, data in read_blobs(root, listing, store.missing(listing)):
            store.put(digest, data)
        assert store.missing(listing) == []
        tree = store.build(version, listing)
        assert scanned(tree) == (version, sorted(listing))


# --------------------------------------------------------------------------- read_blobs


def test_read_blobs_reads_each_wanted_file_once_in_order(code):
    _, listing = scan(code)
    write(code, "pkg/copy.py", "def value():\n    return 1\n")
    _, listing = scan(code)
    mod = sha(b"def value():\n    return 1\n")
    run = sha(b"#!/bin/sh\necho hi\n")
    assert read_blobs(code, listing, [run, mod, run]) == [
        (run, b"#!/bin/sh\necho hi\n"), (mod, b"def value():\n    return 1\n")]
    assert read_blobs(code, listing, []) == []


# --------------------------------------------------------------------------- check_path


@pytest.mark.parametrize("relative", ["pkg/mod.py", "a", "a/b/c.txt", ".hidden/x"])
def test_check_path_accepts_relative_paths_inside_the_tree(relative):
    assert str(check_path(relative)) == relative


@pytest.mark.parametrize("relative", ["../x", "/etc/x", "a/../../b", "a/..", "..", "",
                                      ".", "/", "a/../b"])
def test_check_path_refuses_paths_that_could_leave_the_tree(relative):
    with pytest.raises(ValueError, match="outside the code tree"):
        check_path(relative)


# --------------------------------------------------------------------------- Store


def test_a_store_creates_its_directories_private(tmp_path):
    old_umask = os.umask(0)  # even with a permissive umask
    try:
        store = Store(tmp_path / "deep" / "store")
    finally:
        os.umask(old_umask)
    assert store.blobs.is_dir() and store.trees.is_dir()
    for directory in (store.root, store.blobs, store.trees):
        assert stat.S_IMODE(os.lstat(directory).st_mode) == 0o700, directory
    assert store.tree("0" * 32) is None
    Store(tmp_path / "deep" / "store")  # again: fine


def test_an_own_store_that_only_its_user_can_write_is_used_as_it_is(tmp_path):
    root = tmp_path / "store"
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    data = b"x = 1\n"
    store = Store(root)
    store.put(sha(data), data)
    assert store.missing([("m.py", sha(data), 0o644, len(data))]) == []
    assert stat.S_IMODE(os.lstat(root).st_mode) == 0o755


def test_missing_hashes_what_it_holds_and_drops_a_blob_whose_contents_changed(tmp_path):
    store, version, listing = filled_store(tmp_path / "store", {"m.py": (b"x = 1\n", 0o644)})
    blob = store.blobs / listing[0][1]
    blob.write_bytes(b"x = 2\n")  # same size, other contents: a damaged or planted blob
    assert store.missing(listing) == [listing[0][1]]
    assert not blob.exists()
    store.put(listing[0][1], b"x = 1\n")
    assert (store.build(version, listing) / "m.py").read_bytes() == b"x = 1\n"


def test_missing_lists_only_absent_hashes_each_once_in_listing_order(tmp_path):
    store = Store(tmp_path / "store")
    a, b, c = b"alpha", b"beta", b"gamma"
    store.put(sha(b), b)
    listing = [("x", sha(c), 0o644, 5), ("y", sha(b), 0o644, 4), ("z", sha(a), 0o644, 5),
               ("w", sha(c), 0o755, 5)]
    assert store.missing(listing) == [sha(c), sha(a)]
    store.put(sha(a), a)
    store.put(sha(c), c)
    assert store.missing(listing) == []
    assert store.missing([]) == []


def test_put_keeps_data_under_its_hash_and_is_idempotent(tmp_path):
    store = Store(tmp_path / "store")
    data = os.urandom(1000)
    store.put(sha(data), data)
    store.put(sha(data), data)
    assert (store.blobs / sha(data)).read_bytes() == data
    assert os.listdir(store.blobs) == [sha(data)]


def test_put_refuses_data_that_does_not_match_its_hash_and_keeps_nothing(tmp_path):
    store = Store(tmp_path / "store")
    with pytest.raises(ValueError, match="does not match its hash"):
        store.put(sha(b"what was promised"), b"something else")
    assert os.listdir(store.blobs) == []
    assert store.missing([("x", sha(b"what was promised"), 0o644, 17)]) == [
        sha(b"what was promised")]


@pytest.mark.parametrize("digest", [
    "", "abc", "g" * 64, "A" * 64, "a" * 63, "a" * 65, "../" + "a" * 61,
    "../../../../etc/passwd", "a" * 32 + "/" + "a" * 31, " " + "a" * 63])
def test_put_and_missing_refuse_what_is_not_a_sha256_hash(tmp_path, digest):
    store = Store(tmp_path / "store")
    with pytest.raises(ValueError, match="not a SHA-256 hash"):
        store.put(digest, b"x")
    with pytest.raises(ValueError, match="not a SHA-256 hash"):
        store.missing([("x", digest, 0o644, 1)])
    assert everything_under(tmp_path) == {"store", "store/blobs", "store/trees"}


def test_build_assembles_the_tree_keeping_contents_and_the_executable_bit(tmp_path):
    files = {"pkg/__init__.py": (b"", 0o644), "pkg/mod.py": (b"def value(): return 1\n", 0o644),
             "bin/run.sh": (b"#!/bin/sh\n", 0o755), "deep/a/b/c.txt": (b"c", 0o600),
             "same.py": (b"def value(): return 1\n", 0o755)}
    store, version, listing = filled_store(tmp_path / "store", files)
    tree = store.build(version, listing)
    assert tree == store.trees / version == store.tree(version)
    assert sorted(str(p.relative_to(tree)) for p in tree.rglob("*") if p.is_file()) == sorted(
        files)
    for relative, (data, mode) in files.items():
        path = tree / relative
        assert path.read_bytes() == data
        assert stat.S_IMODE(path.stat().st_mode) & 0o111 == mode & 0o111, relative
        assert os.access(path, os.R_OK)
    assert scanned(tree) == (version, sorted(listing))
    assert [p.name for p in store.trees.iterdir()] == [version]  # no staging left


def test_build_is_idempotent_and_does_not_touch_an_existing_tree(tmp_path):
    store, version, listing = filled_store(tmp_path / "store", {"m.py": (b"x = 1\n", 0o644)})
    tree = store.build(version, listing)
    (tree / "__pycache__").mkdir()  # what a rank's import leaves there
    inode = tree.stat().st_ino
    assert store.build(version, listing) == tree
    assert tree.stat().st_ino == inode and (tree / "__pycache__").is_dir()
    assert [p.name for p in store.trees.iterdir()] == [version]


def test_build_refuses_a_listing_that_does_not_match_its_version(tmp_path):
    store, version, listing = filled_store(tmp_path / "store", {"m.py": (b"x = 1\n", 0o644)})
    other = version_of([("n.py", sha(b"x = 1\n"), 0o644, 6)])
    for wrong, entries in ((other, listing), (version, [("m.py", sha(b"x = 1\n"), 0o755, 6)]),
                           ("../../escape", listing)):
        with pytest.raises(ValueError, match="does not match its version"):
            store.build(wrong, entries)
    assert list(store.trees.iterdir()) == []


def test_build_refuses_a_file_that_was_not_sent(tmp_path):
    store = Store(tmp_path / "store")
    listing = [("m.py", sha(b"never sent"), 0o644, 10)]
    with pytest.raises(ValueError, match=r"m\.py was not sent"):
        store.build(version_of(listing), listing)
    assert store.tree(version_of(listing)) is None


@pytest.mark.parametrize("escape", ["../x", "/etc/x", "a/../../b", "../../../x", "a/..", "",
                                    "../trees/planted"])
def test_build_refuses_paths_that_escape_and_writes_nothing_outside_the_store(tmp_path,
                                                                             escape):
    root = tmp_path / "sandbox"
    store = Store(root / "store")
    data = b"planted = True\n"
    store.put(sha(data), data)
    listing = [("ok.py", sha(data), 0o644, len(data)), (escape, sha(data), 0o644, len(data))]
    version = version_of(listing)
    before = everything_under(tmp_path)
    with pytest.raises(ValueError, match="outside the code tree"):
        store.build(version, listing)
    assert store.tree(version) is None
    written = everything_under(tmp_path) - before
    assert all(p.startswith("sandbox/store/trees/") for p in written), written
    assert not [p for p in written if p.endswith(("/x", "/b", "planted"))], written
    assert not Path("/etc/x").exists() or Path("/etc/x").read_bytes() != data


def test_two_threads_building_the_same_version_both_get_the_tree(tmp_path):
    files = {f"pkg/m{i}.py": (f"v = {i}\n".encode() * 200, 0o644) for i in range(40)}
    files["run.sh"] = (b"#!/bin/sh\n", 0o755)
    for attempt in range(5):
        store, version, listing = filled_store(tmp_path / f"store{attempt}", files)
        barrier = threading.Barrier(2)
        results: list[Path] = []
        errors: list[BaseException] = []

        def build(store=store, version=version, listing=listing, barrier=barrier,
                  results=results, errors=errors):
            barrier.wait()
            try:
                results.append(store.build(version, listing))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=build) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert errors == []
        assert results == [store.trees / version] * 2
        assert scanned(store.trees / version) == (version, sorted(listing))
        assert [p.name for p in store.trees.iterdir()] == [version]


def test_two_stores_on_one_root_share_blobs_and_trees(tmp_path):
    files = {"m.py": (b"x = 1\n", 0o644)}
    first, version, listing = filled_store(tmp_path / "store", files)
    second = Store(tmp_path / "store")
    assert second.missing(listing) == []
    tree = first.build(version, listing)
    assert second.tree(version) == tree
    assert second.build(version, listing) == tree


def test_build_order_of_the_listing_does_not_matter(tmp_path):
    files = {f"{name}.py": (name.encode(), 0o644) for name in "abcdefg"}
    store, version, listing = filled_store(tmp_path / "store", files)
    shuffled = list(listing)
    random.Random(7).shuffle(shuffled)
    assert store.build(version, shuffled) == store.build(version, listing)


# --------------------------------------------------------------------------- default store


def test_the_default_store_is_under_the_cache_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert codesync.default_store() == tmp_path / "cache" / "phalanx" / "agent"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert codesync.default_store() == tmp_path / "home" / ".cache" / "phalanx" / "agent"
    monkeypatch.setenv("XDG_CACHE_HOME", "")
    assert codesync.default_store() == tmp_path / "home" / ".cache" / "phalanx" / "agent"
