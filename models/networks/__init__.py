"""The encoder networks: BERT, ModernBERT, the rotary BERTs (NomicBERT, GTE, Jina v3) and
EuroBERT, each run a layer at a time over a packed batch (models.batch.passes), and their
parts: rotary embeddings, LoRA task adapters, feed-forward blocks by rows.

`NETWORKS` is what the loader builds from: per network (the name models.config.ARCHITECTURES
gives each model type), the module and how HuggingFace checkpoints name its parameters, after
the loader strips the checkpoint's prefix ("bert.", "roberta.", "model.", ...) and maps legacy
LayerNorm gamma/beta to weight/bias. BERT's names are transformers'; the rotary BERTs' cover
both transformers' names (self_attn.q_proj, mlp.gate_proj, ...) and those of the published
remote-code checkpoints (nomic's attn.Wqkv / fc11 / fc12, GTE's qkv_proj / up_gate_proj, Jina's
mixer.Wqkv with torch parametrizations); ModernBERT's and EuroBERT's parameters carry their
checkpoints' names. Old versions' buffers and the NSP pooler are not loaded.
"""

from clusterserve.models.networks.bert import BertModel
from clusterserve.models.networks.eurobert import EuroBertModel
from clusterserve.models.networks.modernbert import ModernBertModel
from clusterserve.models.networks.network import Network
from clusterserve.models.networks.rotary_bert import RotaryBertModel

# The embeddings of BERT and of the rotary BERTs (no position table; nomic's LayerNorm is emb_ln).
_EMBEDDINGS = (
    (r"^embeddings\.word_embeddings\.", "embeddings.word."),
    (r"^embeddings\.position_embeddings\.", "embeddings.position."),
    (r"^embeddings\.token_type_embeddings\.", "embeddings.token_type."),
    (r"^(?:embeddings\.LayerNorm|emb_ln)\.", "embeddings.norm."),
)
_IGNORED = (r"^embeddings\.position_ids$", r"^embeddings\.token_type_ids$", r"^pooler\.")
_LAYER = r"^(?:encoder\.layers?|layers)\.(\d+)\."  # any of the rotary BERTs' layer prefixes
NETWORKS: dict[str, Network] = {
    "bert": Network(
        BertModel,
        anchor="embeddings.word_embeddings.weight",
        names=_EMBEDDINGS + (
            (r"^encoder\.layer\.(\d+)\.attention\.self\.query\.", r"layers.\1.attn.q."),
            (r"^encoder\.layer\.(\d+)\.attention\.self\.key\.", r"layers.\1.attn.k."),
            (r"^encoder\.layer\.(\d+)\.attention\.self\.value\.", r"layers.\1.attn.v."),
            (r"^encoder\.layer\.(\d+)\.attention\.output\.dense\.", r"layers.\1.attn.out."),
            (r"^encoder\.layer\.(\d+)\.attention\.output\.LayerNorm\.", r"layers.\1.attn_norm."),
            (r"^encoder\.layer\.(\d+)\.intermediate\.dense\.", r"layers.\1.mlp_in."),
            (r"^encoder\.layer\.(\d+)\.output\.dense\.", r"layers.\1.mlp_out."),
            (r"^encoder\.layer\.(\d+)\.output\.LayerNorm\.", r"layers.\1.mlp_norm."),
        ),
        ignored=_IGNORED,
    ),
    "rotary_bert": Network(
        RotaryBertModel,
        anchor="embeddings.word_embeddings.weight",
        names=_EMBEDDINGS + (
            (_LAYER + r"self_attn\.([qkv])_proj\.", r"layers.\1.attn.\2."),
            (_LAYER + r"(?:attn\.Wqkv|mixer\.Wqkv|attention\.qkv_proj)\.", r"layers.\1.attn.qkv."),
            (_LAYER + r"(?:self_attn\.o_proj|attn\.out_proj|mixer\.out_proj|attention\.o_proj)\.", r"layers.\1.attn.out."),
            (_LAYER + r"(?:post_attention_layernorm|norm1|attn_ln)\.", r"layers.\1.attn_norm."),
            (_LAYER + r"(?:post_mlp_layernorm|norm2|mlp_ln)\.", r"layers.\1.mlp_norm."),
            (_LAYER + r"mlp\.fc1\.", r"layers.\1.mlp_in."),
            (_LAYER + r"mlp\.(?:gate_proj|fc12)\.", r"layers.\1.mlp_gate."),
            (_LAYER + r"mlp\.(?:up_proj|fc11)\.", r"layers.\1.mlp_up."),
            (_LAYER + r"mlp\.up_gate_proj\.", r"layers.\1.mlp_up_gate."),
            (_LAYER + r"mlp\.(?:down_proj|fc2)\.", r"layers.\1.mlp_out."),
        ),
        ignored=_IGNORED + (r"inv_freq$",),
        fused=(("attn.qkv.", ("attn.q.", "attn.k.", "attn.v.")), ("mlp_up_gate.", ("mlp_up.", "mlp_gate."))),
    ),
    "modernbert": Network(ModernBertModel, anchor="embeddings.tok_embeddings.weight"),
    "eurobert": Network(EuroBertModel, anchor="embed_tokens.weight", ignored=(r"inv_freq$",)),
}
