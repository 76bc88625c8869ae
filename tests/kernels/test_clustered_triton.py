"""The Triton clustered / improved clustered attention end to end against the PyTorch
reference (and exact attention where the method must be exact), on CPU through Triton's
interpreter (small shapes: it runs numpy per program), and the calls' guarantees: no host
synchronisation, bitwise repeatable runs, errors that point to the reference. Nothing here
needs a GPU. The stages alone are in test_clustering_triton.py and test_centroid_triton.py.

Every test runs with row tiles of 16 (several programs per head, so the per-chunk partials
and the launches that reduce them really run)."""

import os

# Before triton is imported anywhere: the kernels are decorated as interpreted functions.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from kernel_inputs import padding_mask, poison_empty, qkv, several_programs_per_head  # noqa: E402

from clusterserve.kernels import AttentionSpec, attention  # noqa: E402
from clusterserve.kernels.reference.full import full_attention  # noqa: E402

pytest.importorskip("clusterserve.kernels.triton.clustered")

METHODS = ("clustered", "i-clustered")


@pytest.fixture(autouse=True)
def _several_programs_per_head(monkeypatch):
    several_programs_per_head(monkeypatch)


@pytest.fixture
def poisoned(monkeypatch):
    poison_empty(monkeypatch)


def run(q, k, v, spec, mask=None, backend="triton"):
    return attention(q, k, v, spec, key_padding_mask=mask, backend=backend)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    "n, m, d, dv, lengths, refine",
    [
        (37, 37, 16, 16, [37, 26], 2),
        (50, 23, 24, 24, None, 0),
        (64, 64, 64, 64, [64, 41], 2),
        (19, 45, 32, 16, [45, 30], 1),
        (24, 24, 128, 128, None, 1),
    ],
)
def test_float32_matches_the_reference(method, n, m, d, dv, lengths, refine):
    q, k, v = qkv(n=n, m=m, d=d, dv=dv)
    mask = None if lengths is None else padding_mask(2, m, lengths)
    spec = AttentionSpec(method=method, clusters=5, topk=7, iterations=6, refine=refine, seed=2)
    got = run(q, k, v, spec, mask)
    assert got.shape == (2, 2, n, dv) and got.dtype == torch.float32
    assert (got - run(q, k, v, spec, mask, backend="reference")).abs().max() <= 1e-4


@pytest.mark.parametrize("method", METHODS)
def test_the_default_knobs_match_the_reference(method):
    # The served Lloyd counts: no Hamming iteration (each query joins its nearest initial
    # centroid, the final launch sums the vectors), then the refinement; a padded row included.
    q, k, v = qkv(n=56, d=32, seed=4)
    mask = padding_mask(2, 56, [56, 33])
    spec = AttentionSpec(method=method, clusters=6, topk=7, seed=5)
    assert spec.iterations == 0 and spec.refine > 0
    got = run(q, k, v, spec, mask)
    assert (got - run(q, k, v, spec, mask, backend="reference")).abs().max() <= 1e-4


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_error_at_most_twice_the_reference(method, dtype):
    q, k, v = qkv(n=40, d=32, dtype=dtype)
    mask = padding_mask(2, 40, [40, 27])
    spec = AttentionSpec(method=method, clusters=5, topk=6, iterations=5, refine=2)
    exact = run(q.double(), k.double(), v.double(), spec, mask, backend="reference")
    got = run(q, k, v, spec, mask)
    assert got.dtype == dtype
    torch_error = (run(q, k, v, spec, mask, backend="reference").double() - exact).abs().max()
    triton_error = (got.double() - exact).abs().max()
    assert triton_error <= 2 * torch_error + 1e-5, (triton_error, torch_error)


@pytest.mark.parametrize("n, m, lengths", [(40, 40, [40, 23]), (37, 53, [53, 30])])
def test_exact_cases_equal_full_attention(n, m, lengths):
    q, k, v = qkv(n=n, m=m)
    mask = padding_mask(2, m, lengths)
    expected = full_attention(q, k, v, mask, 16**-0.5)
    one_per_cluster = AttentionSpec(method="clustered", clusters=64, iterations=2, refine=1)
    all_keys = AttentionSpec(method="i-clustered", clusters=3, topk=64, iterations=3, refine=1)
    for spec in (one_per_cluster, all_keys):
        assert (run(q, k, v, spec, mask) - expected).abs().max() <= 1e-5, spec.method


@pytest.mark.parametrize("method", METHODS)
def test_padded_tokens_have_no_influence_and_padded_queries_are_zero(method):
    spec = AttentionSpec(method=method, clusters=4, topk=5, iterations=4, refine=2)
    q, k, v = qkv(n=40)
    mask = padding_mask(2, 40, [40, 29])
    out = run(q, k, v, spec, mask)
    noisy = [t.clone() for t in (q, k, v)]
    for t in noisy:
        t[1, :, 29:] = torch.randn_like(t[1, :, 29:]) * 100
    out2 = run(*noisy, spec, mask)
    assert torch.equal(out[:, :, :29], out2[:, :, :29]) and torch.equal(out[0], out2[0])
    assert (out[1, :, 29:] == 0).all()


@pytest.mark.parametrize("method", METHODS)
def test_two_runs_are_bitwise_equal(method, poisoned):
    """Every cross-program sum is reduced in a fixed order: the same call gives the same bits."""
    q, k, v = qkv(n=44, dtype=torch.bfloat16)
    mask = padding_mask(2, 44, [44, 30])
    spec = AttentionSpec(method=method, clusters=6, topk=5, iterations=4, refine=2)
    assert torch.equal(run(q, k, v, spec, mask), run(q, k, v, spec, mask))


def test_strided_inputs_give_the_same_output():
    """The model hands over (B, N, H, D) tensors transposed to (B, H, N, D): the kernels read
    them through their strides."""
    q, k, v = qkv(n=33, m=29)
    spec = AttentionSpec(method="i-clustered", clusters=4, topk=5, iterations=3, refine=1)
    strided = [t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v)]
    assert not strided[0].is_contiguous()
    assert torch.equal(run(*strided, spec), run(q, k, v, spec))


def test_all_keys_padded_gives_zero_rows_not_nan():
    q, k, v = qkv(n=16)
    mask = padding_mask(2, 16, [16, 0])
    for method in METHODS:
        out = run(q, k, v, AttentionSpec(method=method, clusters=4, topk=3, iterations=2, refine=1), mask)
        assert torch.isfinite(out).all() and (out[1] == 0).all()


# ---- no host synchronisation, errors ----------------------------------------------------------


def test_no_host_synchronisation(monkeypatch):
    """Outside the kernels nothing reads a tensor's value on the host (.item(), bool(t), ...)
    or compares tensors there; with CUDA tensors each of these would wait for the device."""
    from triton.runtime.interpreter import InterpretedFunction

    guarded = {"on": True}

    def refuse(name):
        original = getattr(torch.Tensor, name)

        def check(self, *args, **kwargs):
            if guarded["on"]:
                raise AssertionError(f"host synchronisation: Tensor.{name}")
            return original(self, *args, **kwargs)

        return check

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, name, refuse(name))
    monkeypatch.setattr(torch, "equal", lambda *a: (_ for _ in ()).throw(AssertionError("torch.equal")))
    launch = InterpretedFunction.run

    def unguarded_launch(self, *args, **kwargs):  # the interpreter itself reads tensors, as a GPU would
        guarded["on"] = False
        try:
            return launch(self, *args, **kwargs)
        finally:
            guarded["on"] = True

    monkeypatch.setattr(InterpretedFunction, "run", unguarded_launch)
    q, k, v = qkv(n=24)
    mask = padding_mask(2, 24, [24, 17])
    for method in METHODS:
        run(q, k, v, AttentionSpec(method=method, clusters=4, topk=4, iterations=3, refine=2), mask)


def test_cpu_tensors_without_the_interpreter_raise(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    q, k, v = qkv(n=8)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        run(q, k, v, AttentionSpec(method="clustered"))


def test_float64_is_refused_with_a_pointer_to_the_reference():
    q, k, v = qkv(n=8, dtype=torch.float64)
    with pytest.raises(ValueError, match="backend='reference'"):
        run(q, k, v, AttentionSpec(method="i-clustered"))
