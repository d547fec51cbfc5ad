"""Where one forward spends its device time, kernel by kernel, from torch's profiler (`bench forward
--kernels N`): for attribution, beside the wall and host times. Without a GPU the table lists the CPU
operators instead, so the path runs in CI. `bench forward --operators N` names the torch operators
behind the kernels, with their input shapes: a copy or elementwise kernel's name does not say which
tensor it moved."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

NAME_WIDTH = 90  # CUTLASS and Triton names run long; the table keeps their heads


@dataclass(frozen=True, slots=True)
class OperatorTime:
    name: str  # the torch operator, e.g. aten::copy_
    shapes: str  # its input shapes, as the profiler records them
    calls: float  # per forward
    us: float  # the device time of the kernels it launched itself, per forward (CPU time without a GPU)
    share: float  # of the summed operator time


@dataclass(frozen=True, slots=True)
class KernelTime:
    name: str
    calls: float  # per forward
    us: float  # self time per forward: device time on a GPU, CPU time without one
    share: float  # of the forward's summed kernel time


def _profiled(run: Callable[[], object], sync: Callable[[], None], iters: int, on_gpu: bool, shapes: bool):
    """The profiler after `iters` runs of `run` (device activity too on a GPU; input shapes if asked)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if on_gpu else [ProfilerActivity.CPU]
    with profile(activities=activities, record_shapes=shapes) as prof:
        for _ in range(iters):
            run()
        sync()
    return prof


def profile_kernels(
    run: Callable[[], object], sync: Callable[[], None], iters: int, on_gpu: bool
) -> list[KernelTime]:
    """Runs `run` `iters` times under the profiler; the kernels (or CPU operators), most time first."""
    from torch.autograd import DeviceType

    prof = _profiled(run, sync, iters, on_gpu, shapes=False)
    wanted = DeviceType.CUDA if on_gpu else DeviceType.CPU
    times = [
        (e.key, e.count, e.self_device_time_total if on_gpu else e.self_cpu_time_total)
        for e in prof.key_averages()
        if e.device_type == wanted
    ]
    total = sum(t for _, _, t in times) or 1.0
    times.sort(key=lambda item: item[2], reverse=True)
    return [KernelTime(name, count / iters, t / iters, t / total) for name, count, t in times if t > 0]


def profile_operators(
    run: Callable[[], object], sync: Callable[[], None], iters: int, on_gpu: bool
) -> list[OperatorTime]:
    """Runs `run` `iters` times under the profiler with shapes recorded; the torch operators by the device
    time of the kernels each launched directly (Triton kernels launched from Python belong to none)."""
    from torch.autograd import DeviceType

    prof = _profiled(run, sync, iters, on_gpu, shapes=True)
    times = [
        (e.key, str(e.input_shapes), e.count, e.self_device_time_total if on_gpu else e.self_cpu_time_total)
        for e in prof.key_averages(group_by_input_shape=True)
        if e.device_type == DeviceType.CPU
    ]
    total = sum(t for *_, t in times) or 1.0
    times.sort(key=lambda item: item[3], reverse=True)
    return [OperatorTime(n, shapes, c / iters, t / iters, t / total) for n, shapes, c, t in times if t > 0]


def _table_lines(title: str, label: str, rows: list[tuple[float, float, float, str]], top: int) -> list[str]:
    """`title`, then the `top` rows (us, share, calls, label), then the rest summed."""
    total_us = sum(row[0] for row in rows)
    lines = [title, f"  {'us':>9s} {'share':>6s} {'calls':>6s}  {label}"]
    for us, share, calls, text in rows[:top]:
        lines.append(f"  {us:9.1f} {share:6.1%} {calls:6.1f}  {text}")
    rest = rows[top:]
    if rest:
        rest_us = sum(row[0] for row in rest)
        lines.append(f"  {rest_us:9.1f} {rest_us / (total_us or 1.0):6.1%} {'':6s}  ({len(rest)} others)")
    return lines


def operator_table_lines(shape: str, operators: list[OperatorTime], top: int) -> list[str]:
    """The `top` operators of one shape with their input shapes, then the rest summed."""
    total_ms = sum(o.us for o in operators) / 1e3
    title = f"operators of {shape}: {total_ms:.2f} ms of kernels launched by torch operators"
    rows = [(o.us, o.share, o.calls, f"{o.name}  {o.shapes[:NAME_WIDTH]}") for o in operators]
    return _table_lines(title, "operator  input shapes", rows, top)


def kernel_table_lines(shape: str, kernels: list[KernelTime], top: int) -> list[str]:
    """The `top` kernels of one shape, then the rest summed, and the total per forward."""
    total_ms = sum(k.us for k in kernels) / 1e3
    title = f"kernels of {shape}: {total_ms:.2f} ms per forward in {len(kernels)} kernels"
    return _table_lines(title, "name", [(k.us, k.share, k.calls, k.name[:NAME_WIDTH]) for k in kernels], top)
