"""DeviceCaches' state operations on CPU tensors."""

from __future__ import annotations

import torch

from deltaserve.cache.device import build_device_caches
from deltaserve.config import ModelConfig
from deltaserve.tiny import make_tiny


def test_clear_states_zeroes_only_the_named_slots(tmp_path):
    cfg = ModelConfig.from_dir(make_tiny(tmp_path / "m", "tiny", weights=False))
    caches = build_device_caches(
        cfg, num_pages=4, page_size=16, num_slots=4, dtype=torch.float32, device=torch.device("cpu")
    )
    states = caches.states
    states.conv.fill_(1.0)
    states.ssm.fill_(2.0)
    caches.clear_states([1, 3])
    for slot in (1, 3):
        assert not states.conv[:, slot].any() and not states.ssm[:, slot].any()
    for slot in (0, 2):
        assert (states.conv[:, slot] == 1.0).all() and (states.ssm[:, slot] == 2.0).all()
