"""AttentionSpec validation and resolution."""

import dataclasses

import pytest

from clusterserve.kernels import KNOB_RANGES, METHODS, AttentionSpec, resolve_auto
from clusterserve.kernels.spec import FieldError, choose_auto


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
    assert resolve_auto(spec, 999).spec.method == "full"
    long = resolve_auto(spec, 1000)
    assert long.spec.method == "smyrf" and long.spec.cluster_size == spec.cluster_size
    assert long.echo == long.spec.used_knobs()
    concrete = AttentionSpec(method="clustered")
    assert resolve_auto(concrete, 1000).spec is concrete


@pytest.mark.parametrize(
    "spec, tokens, exact",
    [
        (AttentionSpec(method="clustered", clusters=100), 100, True),  # every query its own cluster
        (AttentionSpec(method="clustered", clusters=100), 101, False),
        (AttentionSpec(method="i-clustered", clusters=10, topk=64), 64, True),  # every key recomputed
        (AttentionSpec(method="i-clustered", clusters=10, topk=64), 65, False),
        (AttentionSpec(method="smyrf", cluster_size=64), 64, True),  # one cluster
        (AttentionSpec(method="smyrf", cluster_size=64), 65, False),
        (AttentionSpec(method="auto", auto_threshold=10, clusters=100), 50, True),  # auto's i-clustered
    ],
)
def test_a_method_exact_by_its_knobs_runs_exact_attention_and_the_echo_says_what_was_asked(spec, tokens, exact):
    resolved = resolve_auto(spec, tokens)
    asked = choose_auto(spec, tokens)
    if not exact:
        assert resolved == asked and resolved.spec.method != "full"
        return
    assert resolved.spec == dataclasses.replace(asked.spec, method="full")
    assert resolved.echo == {"method": "full", "exact_by_knobs": asked.spec.used_knobs()}


@dataclasses.dataclass(frozen=True)
class Choice:
    spec: AttentionSpec

    def echo(self, target):
        return {**self.spec.used_knobs(), "target_fidelity": target, "calibrated_fidelity": 0.97}


class OneChoiceTable:
    """A table that always chooses `spec` (with the request's seed), recording what it was asked."""

    def __init__(self, spec):
        self.spec, self.asked = spec, []

    def choose(self, tokens, target, seed=0, chunks=False):
        self.asked.append((tokens, target, seed, chunks))
        return Choice(dataclasses.replace(self.spec, seed=seed))


def test_auto_with_a_target_runs_what_the_table_chooses():
    table = OneChoiceTable(AttentionSpec(method="smyrf", hash_rounds=2))
    spec = AttentionSpec(method="auto", auto_threshold=10, seed=5)
    resolved = choose_auto(spec, 3, table=table, target=0.95)  # below the threshold too
    assert table.asked == [(3, 0.95, 5, False)]
    assert resolved.spec.method == "smyrf" and resolved.spec.seed == 5
    assert resolved.echo["target_fidelity"] == 0.95 and resolved.echo["calibrated_fidelity"] == 0.97
    resolve_auto(spec, 3, table=table, target=0.95, chunks=True)  # a late-chunking window: judged by its chunks
    assert table.asked[-1] == (3, 0.95, 5, True)


def test_a_target_without_a_table_falls_back_to_the_threshold_and_says_so():
    spec = AttentionSpec(method="auto", auto_threshold=10)
    resolved = resolve_auto(spec, 300, target=0.9)
    assert resolved.spec.method == spec.auto_method
    assert resolved.echo == {**resolved.spec.used_knobs(), "target_fidelity": 0.9, "calibrated_fidelity": None}
    table = OneChoiceTable(AttentionSpec(method="smyrf"))
    assert resolve_auto(spec, 300, table=table).spec.method == spec.auto_method  # no target: no table
    assert table.asked == []


def test_a_target_with_a_concrete_method_is_refused():
    with pytest.raises(ValueError, match='^target_fidelity: applies to method "auto" only'):
        resolve_auto(AttentionSpec(method="full"), 10, target=0.9)


def test_used_knobs_echo_only_what_the_method_reads():
    assert AttentionSpec(method="full").used_knobs() == {"method": "full"}
    smyrf = AttentionSpec(method="smyrf", hash_rounds=2, cluster_size=32, seed=7).used_knobs()
    assert smyrf == {"method": "smyrf", "hash_rounds": 2, "cluster_size": 32, "seed": 7}
    assert '"topk":32' in AttentionSpec(method="i-clustered").to_json()


def test_attention_resolves_auto_per_row_by_its_real_keys():
    import dataclasses

    import torch

    from clusterserve.kernels import attention

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 40, 8, generator=generator) for _ in range(3))
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, 10:] = False  # row 1 has 10 real tokens: below the threshold, exact
    spec = AttentionSpec(method="auto", auto_threshold=20, auto_method="clustered", clusters=4, seed=1)
    out = attention(q, k, v, spec, mask, backend="reference")
    long = attention(q[:1], k[:1], v[:1], dataclasses.replace(spec, method="clustered"), mask[:1], backend="reference")
    short = attention(q[1:], k[1:], v[1:], AttentionSpec(method="full"), mask[1:], backend="reference")
    torch.testing.assert_close(out[:1], long)
    torch.testing.assert_close(out[1:], short)
    assert not torch.allclose(long, attention(q[:1], k[:1], v[:1], AttentionSpec(method="full"), mask[:1]))


def test_exact_attention_with_a_check_runs_in_query_blocks_to_the_same_result():
    import torch

    from clusterserve.kernels import attention
    from clusterserve.kernels.reference.full import CHECKED_QUERY_BLOCK

    generator = torch.Generator().manual_seed(1)
    n = 2 * CHECKED_QUERY_BLOCK + 5
    q, k, v = (torch.randn(1, 2, n, 8, generator=generator) for _ in range(3))
    mask = torch.ones(1, n, dtype=torch.bool)
    mask[0, -7:] = False
    calls = []
    checked = attention(q, k, v, AttentionSpec(method="full"), mask, check=lambda: calls.append(1))
    assert len(calls) == 3  # one call before each block of queries
    torch.testing.assert_close(checked, attention(q, k, v, AttentionSpec(method="full"), mask), rtol=0, atol=0)

    class Stop(Exception):
        pass

    def stop_second():
        calls.append(1)
        if len(calls) == 5:
            raise Stop

    with pytest.raises(Stop):
        attention(q, k, v, AttentionSpec(method="full"), mask, check=stop_second)


def test_kernels_attention_decides_auto_by_the_one_rule_exact_by_knobs_included():
    import torch

    from clusterserve.kernels import attention

    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 2, 40, 8, generator=generator) for _ in range(3))
    spec = AttentionSpec(method="auto", auto_threshold=10, auto_method="clustered", clusters=64)  # >= 40 keys
    assert resolve_auto(spec, 40).spec.method == "full"
    out = attention(q, k, v, spec, backend="reference")
    torch.testing.assert_close(out, attention(q, k, v, AttentionSpec(method="full"), backend="reference"), rtol=0, atol=0)


def test_bits_zero_takes_no_hamming_iterations():
    """bits 0 (no LSH codes: each query starts at its nearest seed query) leaves nothing for
    Hamming iterations: a clustered method, or auto that may run one, names `iterations`; a
    method that reads neither knob ignores them."""
    assert AttentionSpec(method="i-clustered", bits=0).iterations == 0
    for spec in ({"method": "clustered"}, {"method": "i-clustered"}, {"method": "auto", "auto_method": "clustered"}):
        with pytest.raises(ValueError, match="^iterations: Hamming iterations need LSH codes"):
            AttentionSpec(**spec, bits=0, iterations=2)
    assert AttentionSpec(method="smyrf", bits=0, iterations=2).method == "smyrf"
    assert AttentionSpec(method="auto", auto_method="smyrf", bits=0, iterations=2).bits == 0


def test_bits_and_refine_default_by_how_the_clusters_start():
    """Unset, i-clustered starts from the seed queries (bits 0) with 2 refinement steps,
    clustered (and any Hamming iterations) from 63-bit codes with 3; a value given is kept."""
    start = lambda **knobs: (AttentionSpec(**knobs).bits, AttentionSpec(**knobs).refine)  # noqa: E731
    assert start() == start(method="i-clustered") == start(method="auto") == (0, 2)
    assert start(method="clustered") == start(method="auto", auto_method="clustered") == (63, 3)
    assert start(method="i-clustered", iterations=5) == (63, 3)  # Hamming iterations need codes
    assert start(method="i-clustered", bits=32) == (32, 3) and start(method="clustered", bits=0) == (0, 2)
    assert start(method="i-clustered", refine=4) == (0, 4) and start(method="clustered", refine=1) == (63, 1)
    assert AttentionSpec(bits=0, refine=2) == AttentionSpec()  # the same run, the same spec


def test_with_knobs_lets_defaulted_knobs_follow_the_method():
    served = AttentionSpec(method="auto")
    assert (served.with_knobs(method="clustered").bits, served.with_knobs(method="clustered").refine) == (63, 3)
    assert served.with_knobs(iterations=3).bits == 63  # a request naming only Hamming iterations
    assert dataclasses.replace(served, method="clustered").bits == 0  # what with_knobs is for
    named = AttentionSpec(bits=0, refine=2).with_knobs(method="clustered")
    assert (named.bits, named.refine) == (0, 2)  # named knobs stay as named
    with pytest.raises(FieldError, match="^iterations: Hamming iterations need LSH codes"):
        named.with_knobs(iterations=2)
