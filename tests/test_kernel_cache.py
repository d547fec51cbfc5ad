"""Triton's kernel and autotuning cache lives in deltaserve's cache directory unless the user set one."""

from __future__ import annotations

import os

from deltaserve.cachedir import use_kernel_cache
from deltaserve.engine.core import EngineCore
from deltaserve.engine_config import EngineConfig
from deltaserve.tiny import default_model_dir


def test_the_kernel_cache_goes_under_the_cache_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("DELTASERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    assert use_kernel_cache() == tmp_path / "triton"
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "triton")


def test_a_triton_cache_dir_the_user_set_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("DELTASERVE_CACHE_DIR", str(tmp_path / "ours"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "theirs"))
    assert use_kernel_cache() == tmp_path / "theirs"
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "theirs")


def test_the_engine_sets_it_before_it_builds_the_model(tmp_path, monkeypatch):
    model_dir = default_model_dir()  # built under the real cache directory first
    monkeypatch.setenv("DELTASERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    EngineCore(
        EngineConfig(model=str(model_dir), device="cpu", dtype="float32", max_model_len=256, max_num_seqs=2)
    )
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "triton")
