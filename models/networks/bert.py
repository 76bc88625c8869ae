"""The BERT family encoder: BERT, RoBERTa and XLM-RoBERTa (Devlin et al. 2019, arXiv:1810.04805).

Learned absolute positions, post-norm layers, a GELU MLP. RoBERTa and XLM-RoBERTa are the same
network with positions numbered from padding_idx + 1 (`EncoderConfig.position_offset`).
Attention goes through `kernels.attention`, so any `AttentionSpec` method can replace the
exact softmax.
"""

from __future__ import annotations

from torch import Tensor, nn

from clusterserve.kernels import AttentionSpec, attention
from clusterserve.models.batch.packing import Packed
from clusterserve.models.batch.passes import Pass
from clusterserve.models.config import ACTIVATIONS, EncoderConfig
from clusterserve.models.networks.linear import Linear
from clusterserve.models.networks.rows import by_rows


class BertEmbeddings(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.position_offset = config.position_offset
        self.word = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        # Inputs are single segments: only row 0 of the token-type table is ever used.
        self.token_type = (
            nn.Embedding(config.type_vocab_size, config.hidden_size) if config.type_vocab_size else None
        )
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)

    def forward(self, input_ids: Tensor, packed: Packed) -> Tensor:
        """input_ids: (T,) packed -> (T, C)."""
        x = self.word(input_ids) + self.position(packed.positions + self.position_offset)
        if self.token_type is not None:
            x = x + self.token_type.weight[0]
        return self.norm(x)


class BertAttention(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.q = Linear(config.hidden_size, config.hidden_size)
        self.k = Linear(config.hidden_size, config.hidden_size)
        self.v = Linear(config.hidden_size, config.hidden_size)
        self.out = Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: Tensor, packed: Packed, backend: str = "auto") -> Tensor:
        """x: (T, C) packed -> (T, C)."""
        t, c = x.shape

        def heads(y: Tensor) -> Tensor:
            return y.view(t, self.num_heads, -1)  # (T, H, D)

        def attend(q: Tensor, k: Tensor, v: Tensor, spec: AttentionSpec, mask: Tensor | None) -> Tensor:
            return attention(q, k, v, spec, key_padding_mask=mask, backend=backend, check=packed.check)

        o = packed.attend(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)), attend)
        return self.out(o.reshape(t, c))


class BertLayer(nn.Module):
    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.attn = BertAttention(config)
        self.attn_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp_in = Linear(config.hidden_size, config.intermediate_size)
        self.mlp_out = Linear(config.intermediate_size, config.hidden_size)
        self.mlp_norm = nn.LayerNorm(config.hidden_size, eps=config.norm_eps)
        self.act = ACTIVATIONS[config.activation]

    def forward(self, x: Tensor, packed: Packed, backend: str = "auto") -> Tensor:
        # Post-norm: normalise after each residual sum, as BERT was trained.
        x = self.attn_norm(x + self.attn(x, packed, backend))
        return self.mlp_norm(x + by_rows(self.mlp, x))

    def mlp(self, x: Tensor) -> Tensor:
        return self.mlp_out(self.act(self.mlp_in(x)))


class BertModel(nn.Module):
    """BERT / RoBERTa / XLM-RoBERTa encoder without any task head."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_layers))

    def begin(self, input_ids: Tensor, packed: Packed, backend: str = "auto", adapter: int | None = None) -> Pass:
        return Pass(self.embeddings(input_ids, packed), packed, backend)

    def tables(self, state: Pass) -> None:
        """No tables: the layers read the layout's groups and mask only."""

    def advance(self, state: Pass) -> None:
        state.x = self.layers[state.done](state.x, state.packed, state.backend)
        state.done += 1

    def end(self, state: Pass) -> Tensor:
        return state.x
