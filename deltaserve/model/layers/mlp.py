"""Dense SwiGLU MLP and the sparse MoE block (routed experts + sigmoid-gated shared expert)."""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.config import ModelConfig
from deltaserve.model.layers.parallel import SINGLE, TensorParallel
from deltaserve.model.layers.params import CheckpointTensor, WeightRequirement, new_param, single, stacked
from deltaserve.ops import (
    NormedInput,
    as_tensor,
    linear,
    moe_block_output,
    route,
    swiglu_mlp,
)


class MLP(nn.Module):
    """`intermediate` is this rank's width; `forward` returns down_proj's partial sum under tensor
    parallelism (the caller all-reduces)."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallel = SINGLE,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.intermediate = intermediate
        self.gate_up_proj = new_param((2 * intermediate, hidden), dtype, device)
        self.down_proj = new_param((hidden, intermediate), dtype, device)

    def weight_requirements(self, prefix: str) -> list[WeightRequirement]:
        return [
            stacked(
                self.gate_up_proj,
                [
                    (f"{prefix}.gate_proj.weight", self.intermediate),
                    (f"{prefix}.up_proj.weight", self.intermediate),
                ],
                self.tp.shard(0),
            ),
            single(f"{prefix}.down_proj.weight", self.down_proj, self.tp.shard(1)),
        ]

    @property
    def first_projection(self) -> torch.Tensor:
        """The weight a forward streams first (prefetched ahead of it at GEMV rows)."""
        return self.gate_up_proj

    def forward(self, x: torch.Tensor | NormedInput, then: torch.Tensor | None = None) -> torch.Tensor:
        """`then`: the weight the step streams after this MLP's (prefetched at GEMV rows: ops.linear)."""
        return swiglu_mlp(x, self.gate_up_proj, self.down_proj, then)


class SparseMoeBlock(nn.Module):
    """`cfg` is this rank's geometry: every expert and the shared expert hold a slice of their
    intermediate width, the router is replicated; `forward` returns a partial sum under tensor
    parallelism (the caller all-reduces)."""

    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, tp: TensorParallel = SINGLE
    ) -> None:
        super().__init__()
        self.tp = tp
        hidden = cfg.hidden_size
        self.num_experts = cfg.num_experts
        self.top_k = cfg.num_experts_per_tok
        self.renormalize = cfg.norm_topk_prob
        self.expert_intermediate = cfg.moe_intermediate_size
        self.gate = new_param((cfg.num_experts, hidden), dtype, device)
        self.w13 = new_param((cfg.num_experts, 2 * cfg.moe_intermediate_size, hidden), dtype, device)
        self.w2 = new_param((cfg.num_experts, hidden, cfg.moe_intermediate_size), dtype, device)
        self.shared_expert = MLP(hidden, cfg.shared_expert_intermediate_size, dtype, device, tp)
        self.shared_expert_gate = new_param((1, hidden), dtype, device)

    def weight_requirements(self, prefix: str) -> list[WeightRequirement]:
        inter, tp = self.expert_intermediate, self.tp
        experts = f"{prefix}.experts"
        # Official checkpoints store experts fused in 3-D tensors; HF re-saves store them per expert.
        fused = [
            CheckpointTensor(f"{experts}.gate_up_proj", self.w13, tp.shard(1, (tp.size * inter,) * 2)),
            CheckpointTensor(f"{experts}.down_proj", self.w2, tp.shard(2)),
        ]
        per_expert = []
        for e in range(self.num_experts):
            per_expert += [
                CheckpointTensor(f"{experts}.{e}.gate_proj.weight", self.w13[e, :inter], tp.shard(0)),
                CheckpointTensor(f"{experts}.{e}.up_proj.weight", self.w13[e, inter:], tp.shard(0)),
                CheckpointTensor(f"{experts}.{e}.down_proj.weight", self.w2[e], tp.shard(1)),
            ]
        return [
            single(f"{prefix}.gate.weight", self.gate),
            WeightRequirement([fused, per_expert]),
            *self.shared_expert.weight_requirements(f"{prefix}.shared_expert"),
            single(f"{prefix}.shared_expert_gate.weight", self.shared_expert_gate),
        ]

    @property
    def first_projection(self) -> torch.Tensor:
        """The router's weight: the experts a forward streams are known only once it has routed."""
        return self.gate

    def forward(self, x: torch.Tensor | NormedInput, then: torch.Tensor | None = None) -> torch.Tensor:
        """`then`: the weight the step streams after this block's (prefetched at GEMV rows: ops.linear).
        A pending input norm is computed first: the router, the experts and the shared expert all read it."""
        x = as_tensor(x)
        weights, ids = route(linear(x, self.gate), self.top_k, self.renormalize)
        shared = self.shared_expert(x, self.shared_expert_gate)
        return moe_block_output(x, self.w13, self.w2, weights, ids, shared, self.shared_expert_gate, then)
