"""The step log's device spans on a GPU (DELTASERVE_ITL_DEBUG): a launch's time on the device, and the
stream's idle time before it, which is about 0 for launches queued back to back and shows a host pause."""

from __future__ import annotations

import time

import torch

from deltaserve.cache.device import build_device_caches
from deltaserve.config import ModelConfig
from deltaserve.engine.backend import Backend
from deltaserve.engine.step import DeviceSpan, StepPlan
from deltaserve.model.qwen35 import Qwen35ForCausalLM
from deltaserve.model.weights import load_weights
from deltaserve.tiny import default_model_dir

DEVICE = torch.device("cuda")


def _timed_matmul(a: torch.Tensor, previous: DeviceSpan | None) -> DeviceSpan:
    start = DeviceSpan.mark()
    a @ a
    return DeviceSpan(start, DeviceSpan.mark(), None if previous is None else previous.end)


def test_spans_time_the_work_and_the_idle_stream_between_launches():
    a = torch.randn(4096, 4096, device=DEVICE)
    spans: list[DeviceSpan] = []
    for _ in range(4):
        spans.append(_timed_matmul(a, spans[-1] if spans else None))
    torch.cuda.synchronize()
    assert all(s.done for s in spans)
    assert spans[0].idle_ms() is None
    assert all(s.device_ms() > 0.01 for s in spans)  # a 4096^3 fp32 matmul takes well over 10 us
    assert all(0 <= s.idle_ms() < 0.5 for s in spans[1:])  # queued before the one before ended
    time.sleep(0.05)  # the host pauses with the stream drained
    late = _timed_matmul(a, spans[-1])
    torch.cuda.synchronize()
    assert late.idle_ms() >= 40


@torch.inference_mode()
def test_a_backend_timing_its_steps_chains_each_launch_to_the_one_before():
    model_dir = default_model_dir()
    model = Qwen35ForCausalLM(ModelConfig.from_dir(model_dir), dtype=torch.bfloat16, device=DEVICE)
    load_weights(model, model_dir)
    caches = build_device_caches(
        model.local_config, num_pages=4, page_size=16, num_slots=2, dtype=torch.bfloat16, device=DEVICE
    )
    untimed = Backend(model, caches).launch(StepPlan())
    assert untimed.device_span is None
    backend = Backend(model, caches, time_steps=True)
    first, second = backend.launch(StepPlan()), backend.launch(StepPlan())
    torch.cuda.synchronize()
    assert first.device_span is not None and first.device_span.previous_end is None
    assert second.device_span.previous_end is first.device_span.end
    assert second.device_span.done and second.device_span.device_ms() >= 0
