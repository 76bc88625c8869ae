"""AttentionSpec validation and resolution."""

import pytest

from kernels import KNOB_RANGES, METHODS, AttentionSpec


@pytest.mark.parametrize("name", sorted(KNOB_RANGES))
def test_out_of_range_knob_names_the_field(name):
    low, high = KNOB_RANGES[name]
    for bad in (low - 1, high + 1):
        with pytest.raises(ValueError, match=f"^{name}:"):
            AttentionSpec(**{name: bad})


@pytest.mark.parametrize("name", ["clusters", "topk", "seed"])
@pytest.mark.parametrize("bad", [True, 3.0, "8", None])
def test_non_integer_knob_is_rejected(name, bad):
    with pytest.raises(ValueError, match=f"^{name}:"):
        AttentionSpec(**{name: bad})


def test_unknown_method_lists_the_valid_ones():
    with pytest.raises(ValueError, match="method: must be one of full, clustered"):
        AttentionSpec(method="reformer")
    with pytest.raises(ValueError, match="^auto_method:"):
        AttentionSpec(auto_method="full")


@pytest.mark.parametrize("method", METHODS)
def test_every_method_constructs_with_defaults(method):
    assert AttentionSpec(method=method).method == method


def test_auto_resolves_by_length():
    spec = AttentionSpec(method="auto", auto_threshold=1000, auto_method="smyrf")
    assert spec.resolve(999).method == "full"
    assert spec.resolve(1000).method == "smyrf"
    assert spec.resolve(1000).cluster_size == spec.cluster_size
    concrete = AttentionSpec(method="clustered")
    assert concrete.resolve(10) is concrete


def test_used_knobs_echo_only_what_the_method_reads():
    assert AttentionSpec(method="full").used_knobs() == {"method": "full"}
    smyrf = AttentionSpec(method="smyrf", hash_rounds=2, cluster_size=32, seed=7).used_knobs()
    assert smyrf == {"method": "smyrf", "hash_rounds": 2, "cluster_size": 32, "seed": 7}
    assert '"topk":32' in AttentionSpec(method="i-clustered").to_json()
