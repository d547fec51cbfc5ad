"""Triton's installation hash is kept in the cache directory under a fingerprint of the files it hashes
(deltaserve/triton_key.py): read back while they are unchanged, computed again once one changes."""

from __future__ import annotations

import os

import pytest

from deltaserve.triton_key import installation_fingerprint, remembered_key, reuse_triton_key


def _tree(root):
    (root / "compiler").mkdir(parents=True)
    (root / "_C").mkdir()
    (root / "compiler" / "code_generator.py").write_text("x = 1\n")
    (root / "_C" / "libtriton.so").write_bytes(b"\0" * 64)
    (root / "tools").mkdir()
    (root / "tools" / "unrelated.py").write_text("y = 2\n")
    return root


def test_the_fingerprint_follows_size_and_modification_time_of_the_hashed_files_only(tmp_path):
    root = _tree(tmp_path / "triton")
    first = installation_fingerprint(root)
    assert installation_fingerprint(root) == first
    (root / "tools" / "unrelated.py").write_text("y = 3\n")  # not a file triton_key() reads
    assert installation_fingerprint(root) == first
    library = root / "_C" / "libtriton.so"
    stat = library.stat()
    os.utime(library, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # a reinstall: same size, new time
    second = installation_fingerprint(root)
    assert second != first
    (root / "compiler" / "code_generator.py").write_text("x = 10\n")  # an edit that changes the size
    assert installation_fingerprint(root) not in (first, second)


def test_a_remembered_key_is_computed_once_then_read_back(tmp_path):
    store = tmp_path / "triton-key" / "3.6.0-abc"
    calls = []

    def compute():
        calls.append(1)
        return "3.6.0-hash"

    assert remembered_key(store, compute) == "3.6.0-hash"
    assert remembered_key(store, compute) == "3.6.0-hash"
    assert len(calls) == 1
    assert [p.name for p in store.parent.iterdir()] == ["3.6.0-abc"]  # no staging file left behind


def test_triton_reads_the_remembered_key_and_it_equals_its_own(tmp_path, monkeypatch):
    cache = pytest.importorskip("triton.runtime.cache")
    autotuner = pytest.importorskip("triton.runtime.autotuner")
    monkeypatch.setenv("DELTASERVE_CACHE_DIR", str(tmp_path))
    original = cache.triton_key
    monkeypatch.setattr(cache, "triton_key", original)
    monkeypatch.setattr(autotuner, "triton_key", original)
    reuse_triton_key()
    assert cache.triton_key is not original and autotuner.triton_key is cache.triton_key
    assert cache.triton_key() == original()
    (stored,) = (tmp_path / "triton-key").iterdir()
    assert stored.read_text() == original()
    patched = cache.triton_key
    reuse_triton_key()  # a second call keeps the first replacement
    assert cache.triton_key is patched
