"""Linear and embedding layers with per-task LoRA adapters (Hu et al. 2021, arXiv:2106.09685).

Jina v3 stores, beside each base weight W, one low-rank pair per task t; the task's weight is
W + scaling * delta_t with scaling = alpha / rank:
- linear, W (out, in): lora_A (T, r, in), lora_B (T, out, r), delta_t = B[t] @ A[t];
- embedding, W (vocab, C): lora_A (T, vocab, r), lora_B (T, r, C), delta_t = A[t] @ B[t].
The delta is applied to the activations (x A^T B^T), never merged into W, so one loaded model
serves every task and no call pays for a (vocab x C) matrix. With `adapter=None` or no adapters
the layers are plain `Linear` (models.networks.linear) / `nn.Embedding`.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from clusterserve.models.config import EncoderConfig
from clusterserve.models.networks.linear import Linear


class AdaptedLinear(Linear):
    def __init__(self, in_features: int, out_features: int, bias: bool, config: EncoderConfig):
        super().__init__(in_features, out_features, bias=bias)
        tasks, rank = len(config.adapters), config.lora_rank
        self.scaling = config.lora_alpha / rank if tasks else 0.0
        if tasks:
            self.lora_A = nn.Parameter(self.weight.new_empty(tasks, rank, in_features))
            self.lora_B = nn.Parameter(self.weight.new_empty(tasks, out_features, rank))

    def forward(self, x: Tensor, adapter: int | None = None) -> Tensor:
        out = self.product(x)
        if adapter is None:
            return out
        low_rank = F.linear(F.linear(x, self.lora_A[adapter]), self.lora_B[adapter])
        return out + self.scaling * low_rank


class AdaptedEmbedding(nn.Embedding):
    def __init__(self, num_embeddings: int, dim: int, config: EncoderConfig):
        super().__init__(num_embeddings, dim)
        tasks, rank = len(config.adapters), config.lora_rank
        self.scaling = config.lora_alpha / rank if tasks else 0.0
        if tasks:
            self.lora_A = nn.Parameter(self.weight.new_empty(tasks, num_embeddings, rank))
            self.lora_B = nn.Parameter(self.weight.new_empty(tasks, rank, dim))

    def forward(self, ids: Tensor, adapter: int | None = None) -> Tensor:
        out = F.embedding(ids, self.weight)
        if adapter is None:
            return out
        return out + self.scaling * (F.embedding(ids, self.lora_A[adapter]) @ self.lora_B[adapter])
