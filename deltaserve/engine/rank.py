"""One rank's device state: its model shard, weights, warm-up, memory plan and caches.

`build_rank` runs in the same order on every rank (EngineCore for rank 0, engine/tp.py's rank processes
for the others): under tensor parallelism the warm-up's forwards and the agreements (max_num_seqs, page
count) are collectives. Memory plan: weights (refused up front when they cannot fit) -> max_num_seqs
(by default from the memory left: `choose_max_num_seqs`) -> warm-up at the real chunk shapes (activation
peak measured) -> state slots for max_num_seqs -> KV pages from what is left under
--gpu-memory-utilization, less the buffers allocated after it (the graphs' shared logits, the
sampler's penalty counts).

With --speculative-config the model carries the checkpoint's MTP head: its attention layer is the last
layer of the KV pool (every page holds it), and the state pool ends with `verify_scratch_slots` slots
(max_num_seqs + 1 onwards) that verify forwards work in: no sequence may hold them (the cache
manager's slots are 1..max_num_seqs).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from deltaserve.cache.device import DeviceCaches, build_device_caches
from deltaserve.config import ModelConfig
from deltaserve.engine.cuda_graphs import logits_buffer_bytes
from deltaserve.engine.penalty_counts import penalty_counts_bytes
from deltaserve.engine.warmup import WarmupReport, warm_up
from deltaserve.engine_config import (
    AUTO_MAX_NUM_SEQS,
    AUTO_SEQS_STATE_SHARE,
    CPU_MAX_NUM_SEQS,
    EngineConfig,
)
from deltaserve.errors import ConfigError
from deltaserve.model.layers.parallel import TensorParallel
from deltaserve.model.layers.peer_all_reduce import PeerAllReduce, peer_all_reduce_wanted
from deltaserve.model.qwen35 import Qwen35ForCausalLM
from deltaserve.model.weights import checkpoint_has_mtp, init_dummy_weights, load_weights
from deltaserve.triton_key import reuse_triton_key

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_GB = 0.25
CPU_DEFAULT_SNAPSHOT_GB = 0.25
# The prefix cache's GDN state snapshots by default: 8% of the GPU's memory, but never more than a quarter
# of what the weights leave under --gpu-memory-utilization (the rest is for the KV pages, the state slots
# and the activations). A 35B-A3B on an 80 GB GPU leaves ~5 GiB, of which 8% of the GPU (6.3 GiB) would
# have taken all and more.
GPU_SNAPSHOT_SHARE = 0.08
SNAPSHOT_SHARE_OF_LEFT = 0.25
GRAPH_RESERVE_BYTES = 256 << 20


@dataclass(slots=True)
class RankState:
    """What one rank owns: its model shard and its caches, and the config they were built for (its
    max_num_seqs resolved, the same on every rank)."""

    model: Qwen35ForCausalLM
    caches: DeviceCaches
    device: torch.device
    dtype: torch.dtype
    config: EngineConfig


def tp_on_one_gpu() -> bool:
    """DELTASERVE_TP_ONE_GPU=1: every rank on the one configured GPU, joined over gloo instead of NCCL, so
    the tensor-parallel code paths run where only one GPU is (to debug them). It does not exercise NCCL,
    rank r on cuda:r, nor graphs (gloo's collectives cannot be captured). The ranks share the GPU's
    memory: give each a share, --gpu-memory-utilization 0.9 / N."""
    return os.environ.get("DELTASERVE_TP_ONE_GPU", "0") == "1"


def rank_device(device: torch.device, rank: int, size: int) -> torch.device:
    """Rank `rank`'s device: cuda:rank under tensor parallelism on CUDA (with `tp_on_one_gpu` the
    configured GPU, for every rank), else `device`."""
    if size == 1 or device.type != "cuda":
        return device
    if tp_on_one_gpu():
        return torch.device("cuda", device.index or 0)
    return torch.device("cuda", rank)


def _tp_text(tp: TensorParallel) -> str:
    if tp.size == 1:
        return ""
    sums = f"peer sums up to {tp.peer.buffer.nbytes >> 20} MiB, NCCL above" if tp.peer else "NCCL sums"
    return f", tensor-parallel rank {tp.rank} of {tp.size}, {sums}"


def build_rank(
    config: EngineConfig,
    model_dir: Path,
    model_config: ModelConfig,
    tokenizer_vocab: int,
    tp: TensorParallel,
    *,
    decode_graphs: bool = False,
) -> RankState:
    """Model shard -> weights -> warm-up at the real chunk shapes (GPU) -> KV pages from what is left ->
    caches. Every rank runs this in the same order: under tensor parallelism the warm-up's forwards and
    the page-count agreement are collectives. `decode_graphs`: this rank will capture decode graphs
    (on CUDA), whose logits buffer the KV pages leave room for."""
    device = rank_device(config.resolved_device(), tp.rank, tp.size)
    if tp.size > 1 and device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = config.resolved_dtype(device)
    if tp.size > 1 and peer_all_reduce_wanted():  # a collective, before the model exists
        tp = dataclasses.replace(tp, peer=PeerAllReduce.create(device, dtype))
    if device.type == "cuda":
        reuse_triton_key()  # before the first kernel compiles
    mtp = config.speculative_config is not None
    if mtp and config.load_format != "dummy" and not checkpoint_has_mtp(model_dir):
        raise ConfigError(
            f"{model_dir}: the checkpoint has no MTP weights (mtp.*); --speculative-config method 'mtp' "
            "needs them (serve without --speculative-config, or a checkpoint that ships its MTP head)"
        )
    started = time.monotonic()

    def build(on: torch.device) -> Qwen35ForCausalLM:
        return Qwen35ForCausalLM(
            model_config,
            dtype=dtype,
            device=on,
            logits_vocab_size=tokenizer_vocab,
            tp=tp,
            mtp=mtp,
            draft_vocab_size=config.speculative_config.draft_vocab_size if mtp else None,
        )

    if device.type == "cuda":
        torch.cuda.init()  # the driver and the context: timed apart from the size check below
    device_started = time.monotonic()
    if device.type == "cuda":
        release_unreferenced_device_memory()
        free, total = torch.cuda.mem_get_info(device)
        check_weights_fit(
            weight_bytes(build(torch.device("meta"))),
            free,
            total,
            config.gpu_memory_utilization,
            model_config,
            tp,
        )
    checked = time.monotonic()
    model = build(device)
    allocated = time.monotonic()
    if config.load_format == "dummy":
        init_dummy_weights(model, seed=config.seed)
    else:
        load_weights(model, model_dir)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    loaded = time.monotonic()
    logger.info(
        "model loaded from %s in %.1f s (%s, %s%s; device start %.1f s, size check %.1f s, parameters "
        "allocated %.1f s, weights %.1f s)",
        model_dir,
        loaded - started,
        device,
        dtype,
        _tp_text(tp),
        device_started - started,
        checked - device_started,
        allocated - checked,
        loaded - allocated,
    )
    local = model.local_config
    num_snapshots = plan_state_snapshots(config, local, device, dtype)
    config = _resolve_max_num_seqs(config, local, device, dtype, num_snapshots, tp)
    if mtp:
        _log_speculative_memory(config, model, dtype)
    warmup = _warm_up(config, model, local, dtype, device) if device.type == "cuda" else None
    fixed: dict[str, int] = {}
    if device.type == "cuda":
        if decode_graphs:
            fixed["decode graphs' logits"] = logits_buffer_bytes(graph_logits_rows(config), tokenizer_vocab)
        if tp.rank == 0:  # the rank that samples
            fixed["penalty counts"] = penalty_counts_bytes(state_pool_slots(config), tokenizer_vocab)
    num_pages = _plan_kv_pages(
        config, local, device, dtype, warmup, num_snapshots, model.num_kv_layers, fixed
    )
    if tp.size > 1:
        num_snapshots = agree_on_minimum(num_snapshots, device)
        num_pages = agree_on_minimum(num_pages, device)
    caches = build_device_caches(
        local,
        num_pages=num_pages,
        page_size=config.page_size,
        num_slots=state_pool_slots(config),
        dtype=dtype,
        device=device,
        num_snapshots=num_snapshots,
        num_kv_layers=model.num_kv_layers,
    )
    return RankState(model, caches, device, dtype, config)


def choose_max_num_seqs(cache_bytes: float, state_bytes_per_sequence: int) -> int:
    """The first of AUTO_MAX_NUM_SEQS whose state slots (and the reserved slot 0) take at most
    AUTO_SEQS_STATE_SHARE of `cache_bytes` (the memory for state slots, KV pages and activations), else
    the last."""
    for seqs in AUTO_MAX_NUM_SEQS[:-1]:
        if (seqs + 1) * state_bytes_per_sequence <= AUTO_SEQS_STATE_SHARE * cache_bytes:
            return seqs
    return AUTO_MAX_NUM_SEQS[-1]


def _resolve_max_num_seqs(
    config: EngineConfig,
    local: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    num_snapshots: int,
    tp: TensorParallel,
) -> EngineConfig:
    """The config with max_num_seqs given, or chosen from the memory left after the weights and the
    snapshot pool (on CPU: CPU_MAX_NUM_SEQS); the smallest choice over the ranks."""
    if config.max_num_seqs is not None:
        return config
    per_sequence = local.state_bytes_per_sequence(dtype)
    seqs = CPU_MAX_NUM_SEQS
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        cache_bytes = share_left(config.gpu_memory_utilization, free, total) - num_snapshots * per_sequence
        seqs = choose_max_num_seqs(cache_bytes, per_sequence)
    if tp.size > 1:
        seqs = agree_on_minimum(seqs, device)
    logger.info(
        "max_num_seqs %d (--max-num-seqs by default: the first of %s whose state slots of %.1f MiB each "
        "take at most %.0f%% of the memory for caches; %d on the CPU)",
        seqs,
        ", ".join(map(str, AUTO_MAX_NUM_SEQS)),
        per_sequence / 2**20,
        100 * AUTO_SEQS_STATE_SHARE,
        CPU_MAX_NUM_SEQS,
    )
    return dataclasses.replace(config, max_num_seqs=seqs)


def graph_logits_rows(config: EngineConfig) -> int:
    """Rows of the graphs' shared float32 logits buffers: the decode graphs' (max_num_seqs) and, with
    speculative decoding, the verify graphs' (a row per position of their largest bucket)."""
    spec = config.speculative_config
    verify = 0 if spec is None else min(spec.max_batch, config.num_seqs) * (spec.num_speculative_tokens + 1)
    return config.num_seqs + verify


def state_pool_slots(config: EngineConfig) -> int:
    """Slots of the state pool: the reserved slot 0, one per sequence, then the verify scratch slots."""
    return config.num_seqs + 1 + verify_scratch_slots(config)


def verify_scratch_slots(config: EngineConfig) -> int:
    """State slots a speculative verify step works in (one per drafted position of each speculating
    row: max_batch x num_speculative_tokens); 0 without speculation. They follow the sequences' slots:
    max_num_seqs + 1 onwards."""
    spec = config.speculative_config
    return 0 if spec is None else spec.max_batch * spec.num_speculative_tokens


def _log_speculative_memory(config: EngineConfig, model: Qwen35ForCausalLM, dtype: torch.dtype) -> None:
    local = model.local_config
    scratch = verify_scratch_slots(config)
    first = config.num_seqs + 1
    kv_layer = local.kv_bytes_per_token(dtype, 1) * config.page_size
    logger.info(
        "speculative decoding: the MTP head (KV layer %d, %.1f KiB per page), %d verify scratch state "
        "slots (%d..%d, %.2f GiB)",
        model.mtp_kv_index,
        kv_layer / 2**10,
        scratch,
        first,
        first + scratch - 1,
        scratch * local.state_bytes_per_sequence(dtype) / 2**30,
    )


def _warm_up(
    cfg: EngineConfig, model: Qwen35ForCausalLM, local: ModelConfig, dtype: torch.dtype, device: torch.device
) -> WarmupReport:
    """Kernels compile and autotune at the real chunk shapes on a throwaway two-page KV pool."""
    scratch = build_device_caches(
        local,
        num_pages=2,
        page_size=cfg.page_size,
        num_slots=state_pool_slots(cfg),
        dtype=dtype,
        device=device,
        num_kv_layers=model.num_kv_layers,
    )
    report = warm_up(model, scratch, cfg.largest_step_tokens, cfg.num_seqs, sample=model.tp.rank == 0)
    del scratch
    torch.cuda.empty_cache()
    logger.info(
        "warm-up at the real chunk shapes: %.1f s (%s), activation peak %.2f GiB",
        report.seconds,
        report.phase_summary(),
        report.peak_activation_bytes / 2**30,
    )
    if report.fresh_attention_plans:
        logger.info(
            "fresh prefill attention: %d cuDNN plans built (lengths up to %d tokens)",
            report.fresh_attention_plans,
            cfg.largest_step_tokens,
        )
    return report


def plan_state_snapshots(
    cfg: EngineConfig, local: ModelConfig, device: torch.device, dtype: torch.dtype
) -> int:
    """GDN state snapshots for the prefix cache, planned before the KV pages: the memory budget
    (--prefix-cache-state-memory-gb; by default `default_snapshot_bytes`, or a fixed amount on CPU) over
    one sequence's state (conv + SSM of every GDN layer, at the live state's dtypes)."""
    if not cfg.enable_prefix_caching:
        return 0
    per_snapshot = local.state_bytes_per_sequence(dtype)
    gib = cfg.prefix_cache_state_memory_gb
    if gib is None and device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        gib = default_snapshot_bytes(total, share_left(cfg.gpu_memory_utilization, free, total)) / 2**30
    elif gib is None:
        gib = CPU_DEFAULT_SNAPSHOT_GB
    count = int(gib * 2**30 // per_snapshot)
    logger.info(
        "prefix cache: %d GDN state snapshots of %.1f MiB (%.2f GiB; --prefix-cache-state-memory-gb)",
        count,
        per_snapshot / 2**20,
        count * per_snapshot / 2**30,
    )
    return count


def default_snapshot_bytes(total: int, left: float) -> float:
    """The snapshot pool's default size on a GPU of `total` bytes where the loaded weights leave `left`
    bytes under --gpu-memory-utilization: GPU_SNAPSHOT_SHARE of the GPU, at most SNAPSHOT_SHARE_OF_LEFT of
    `left` (none where nothing is left)."""
    return max(0.0, min(GPU_SNAPSHOT_SHARE * total, SNAPSHOT_SHARE_OF_LEFT * left))


def _plan_kv_pages(
    cfg: EngineConfig,
    local: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    warmup: WarmupReport | None,
    num_snapshots: int = 0,
    num_kv_layers: int | None = None,
    fixed: dict[str, int] | None = None,
) -> int:
    """KV pages for this rank (`local` is its geometry: its KV heads and GDN heads), from what is left
    after the state slots (the sequences' and the verify scratch slots), the prefix cache's snapshots
    and the `fixed` buffers allocated later (by what they hold: the graphs' logits, the sampler's penalty
    counts). A page holds `num_kv_layers` layers (default: the full-attention layers)."""
    if cfg.num_kv_pages is not None:
        return cfg.num_kv_pages
    page_bytes = local.kv_bytes_per_token(dtype, num_kv_layers) * cfg.page_size
    per_sequence = local.state_bytes_per_sequence(dtype)
    slot_bytes, snapshot_bytes = state_pool_slots(cfg) * per_sequence, num_snapshots * per_sequence
    if device.type == "cuda":
        assert warmup is not None
        free, total = torch.cuda.mem_get_info(device)
        # The state pools and the `fixed` buffers are allocated after this; graph capture needs a little
        # room of its own besides.
        fixed = fixed or {}
        reserve = slot_bytes + snapshot_bytes + warmup.peak_activation_bytes + sum(fixed.values())
        budget = share_left(cfg.gpu_memory_utilization, free, total) - reserve - GRAPH_RESERVE_BYTES
        where = (
            f"GPU {total / 2**30:.1f} GiB x {cfg.gpu_memory_utilization} utilization, "
            f"{(total - free) / 2**30:.1f} GiB in use (weights, context), state slots "
            f"{slot_bytes / 2**30:.2f} GiB, prefix-cache snapshots {snapshot_bytes / 2**30:.2f} GiB, "
            f"activations {warmup.peak_activation_bytes / 2**30:.2f} GiB"
            + "".join(f", {what} {size / 2**30:.2f} GiB" for what, size in fixed.items())
        )
        flag = "raise --gpu-memory-utilization, or lower --max-num-seqs or --max-num-batched-tokens"
        if snapshot_bytes:
            flag += " or --prefix-cache-state-memory-gb"
    else:
        budget = (cfg.kv_cache_memory_gb or CPU_DEFAULT_KV_GB) * 2**30
        where = f"--kv-cache-memory-gb {cfg.kv_cache_memory_gb or CPU_DEFAULT_KV_GB}"
        flag = "raise --kv-cache-memory-gb"
    pages = int(budget // page_bytes) + 1  # + the reserved page
    if pages < 2:
        raise ConfigError(f"no memory left for the KV cache ({where}); {flag}")
    return pages


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer (a model built on the meta device allocates none)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def share_left(utilization: float, free: int, total: int) -> float:
    """Bytes this process may still allocate: --gpu-memory-utilization of the GPU, less what is in use."""
    return utilization * total - (total - free)


def release_unreferenced_device_memory() -> None:
    """Gives the driver back what this process's allocator caches but nothing references (an earlier
    engine of the process, shut down and dropped, whose objects may wait in reference cycles): the sizing
    below reads the driver's free memory, in which the allocator's cached blocks count as used."""
    gc.collect()
    torch.cuda.empty_cache()


def check_weights_fit(
    needed: int, free: int, total: int, utilization: float, model_config: ModelConfig, tp: TensorParallel
) -> None:
    """Refuses, before anything is allocated, weights that cannot fit in this rank's share of the GPU
    (--gpu-memory-utilization of its memory, less what is already in use): a one-line error instead of
    an out-of-memory traceback part-way through loading."""
    budget = share_left(utilization, free, total)
    if needed <= budget:
        return
    what = (
        f"this rank's shard of the weights (1 of {tp.size}) needs"
        if tp.size > 1
        else "the model's weights need"
    )
    dequantized = (
        " (FP8 weights are served dequantized: twice their size on disk)"
        if model_config.weight_quantization is not None
        else ""
    )
    raise ConfigError(
        f"{what} {needed / 2**30:.1f} GiB{dequantized}, but {max(budget, 0) / 2**30:.1f} GiB of the GPU "
        f"are available ({total / 2**30:.1f} GiB x {utilization} utilization, {(total - free) / 2**30:.1f} "
        "GiB in use); raise --tensor-parallel-size or --gpu-memory-utilization, or use a larger GPU"
    )


def agree_on_minimum(value: int, device: torch.device) -> int:
    """The smallest `value` over the ranks (KV pages: every rank's pool must hold the same pages)."""
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
