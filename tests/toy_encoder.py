"""A small packed tower with per-item attention, and its GraphableEncoder.

It exercises everything the manager does (cu_seqlens padding, two paths, an
optional path with zero tokens) at a size that runs hundreds of batches a second.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from lightning_cg.engine.encoder import CaptureSpec, EncoderGraphConfig, ItemSpec, PathConfig


class ToyTower(nn.Module):
    """tower(tokens [T, D_in], lengths [N]) -> [T (+ N * global_tokens), D_out]."""

    def __init__(self, dim_in: int = 8, dim: int = 16, global_tokens: int = 0) -> None:
        super().__init__()
        self.global_tokens = global_tokens
        self.embed = nn.Linear(dim_in, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.eval()  # as a served tower is: train mode runs eagerly

    def body(self, tokens: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)  # (T, D)
        positions = torch.arange(x.shape[0], device=x.device)
        # Rows past cu_seqlens[-1] share one id: padding attends only padding.
        sequence_ids = torch.searchsorted(cu_seqlens, positions, right=True)
        mask = sequence_ids[:, None] == sequence_ids[None, :]
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        attended = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask)[0]
        return self.out(x + attended)

    def global_view(self, tokens: torch.Tensor, lengths: Sequence[int]) -> torch.Tensor:
        # Evenly spaced rows of each item: a fixed-size view of any length.
        rows, start = [], 0
        for length in lengths:
            rows += [
                start + (length - 1) * i // max(self.global_tokens - 1, 1)
                for i in range(self.global_tokens)
            ]
            start += length
        return tokens[rows]

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        lengths_list = lengths.tolist()
        local = self.body(tokens, cumulative(lengths_list, tokens.device))
        if not self.global_tokens or not lengths_list:
            return local
        views = self.global_view(tokens, lengths_list)
        global_rows = self.body(
            views, cumulative([self.global_tokens] * len(lengths_list), tokens.device)
        )
        parts = []
        for item_local, item_global in zip(
            local.split(lengths_list), global_rows.split(self.global_tokens), strict=True
        ):
            parts += [item_local, item_global]
        return torch.cat(parts) if parts else local


def cumulative(lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + length)
    return torch.tensor(offsets, dtype=torch.int32, device=device)


@dataclass
class ToyInputs:
    tokens: torch.Tensor
    lengths: list[int]


class ToyEncoder:
    """GraphableEncoder of :class:`ToyTower`: paths ``local`` and ``global``."""

    def __init__(
        self, tower: ToyTower, max_budget: int = 64, per_item_metadata: bool = False
    ) -> None:
        self.tower = tower
        self.max_budget = max_budget
        self.per_item_metadata = per_item_metadata

    def graph_config(self) -> EncoderGraphConfig:
        return EncoderGraphConfig(
            paths={
                "local": PathConfig(min_token_budget=8, per_item_metadata=self.per_item_metadata),
                "global": PathConfig(min_token_budget=max(self.tower.global_tokens, 1)),
            },
            padding_rules={"cu_seqlens": "repeat_last"},
        )

    def token_budget_range(self, path: str) -> tuple[int, int]:
        if path == "global":
            per_item = max(self.tower.global_tokens, 1)
            return per_item, per_item * 8
        return 8, self.max_budget

    def inputs_from_call(self, args: tuple, kwargs: dict) -> ToyInputs:
        tokens, lengths = args
        return ToyInputs(tokens, [int(n) for n in lengths.tolist()])

    def item_specs(self, inputs: ToyInputs) -> list[ItemSpec]:
        g = self.tower.global_tokens
        return [ItemSpec(n, n + g, {"local": n, "global": g}) for n in inputs.lengths]

    def select_items(self, inputs: ToyInputs, indices: Sequence[int]) -> ToyInputs:
        items = inputs.tokens.split(inputs.lengths)
        chosen = [items[i] for i in indices]
        tokens = torch.cat(chosen) if chosen else inputs.tokens[:0]
        return ToyInputs(tokens, [inputs.lengths[i] for i in indices])

    def graph_signature(self, inputs: ToyInputs) -> tuple:
        return (inputs.tokens.dtype, inputs.tokens.device)

    def capture_inputs(self, spec: CaptureSpec) -> dict[str, torch.Tensor]:
        dtype, device = spec.signature
        width = self.tower.embed.in_features
        cu_seqlens = torch.full((spec.max_frames + 1,), spec.token_budget, dtype=torch.int32)
        cu_seqlens[0] = 0
        return {
            "tokens": torch.randn(spec.token_budget, width, dtype=dtype, device=device),
            "cu_seqlens": cu_seqlens.to(device),
        }

    def replay_inputs(self, path: str, inputs: ToyInputs) -> dict[str, torch.Tensor]:
        tokens, lengths = self._path_rows(path, inputs)
        return {"tokens": tokens, "cu_seqlens": cumulative(lengths, tokens.device)}

    def graph_forward(self, path: str, buffers: Mapping[str, torch.Tensor]) -> torch.Tensor:
        return self.tower.body(buffers["tokens"], buffers["cu_seqlens"])

    def eager_forward(self, path: str, inputs: ToyInputs) -> torch.Tensor:
        tokens, lengths = self._path_rows(path, inputs)
        return self.tower.body(tokens, cumulative(lengths, tokens.device))

    def postprocess(
        self, outputs: list[dict[str, torch.Tensor]], inputs: ToyInputs
    ) -> torch.Tensor:
        parts = [
            rows
            for item in outputs
            for path in ("local", "global")
            if (rows := item.get(path)) is not None
        ]
        if not parts:
            return inputs.tokens.new_zeros(0, self.tower.out.out_features)
        return torch.cat(parts)

    def _path_rows(self, path: str, inputs: ToyInputs) -> tuple[torch.Tensor, list[int]]:
        if path == "local":
            return inputs.tokens, inputs.lengths
        g = self.tower.global_tokens
        return self.tower.global_view(inputs.tokens, inputs.lengths), [g] * len(inputs.lengths)
