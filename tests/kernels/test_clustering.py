"""LSH codes, Hamming K-means, refinement and the linear-memory guarantee."""

import pytest
import torch
from kernel_inputs import APPROXIMATE, padding_mask, qkv
from torch.utils._python_dispatch import TorchDispatchMode

from clusterserve.kernels import AttentionSpec, attention
from clusterserve.kernels.reference.clustered import REFERENCE, cluster_tiles
from clusterserve.kernels.reference.hashing import hash_codes, hash_planes, hash_signs, pack_codes, unpack_bits
from clusterserve.kernels.reference.kmeans import hamming_kmeans
from clusterserve.kernels.stages import cluster_queries


@pytest.mark.parametrize("bits", [1, 8, 63])
def test_codes_pack_the_projection_signs(bits):
    q, _, _ = qkv(n=30, d=16)
    planes = hash_planes(2, 16, bits, seed=0)
    signs = hash_signs(q, planes)
    codes = hash_codes(q, planes)
    assert codes.dtype == torch.int64 and (codes >= 0).all() and ((codes >> bits) == 0).all()
    assert torch.equal(unpack_bits(codes, bits) * 2 - 1, signs)
    # The bias row shifts the hyperplanes off the origin: a zero query still hashes.
    zero_code = hash_codes(torch.zeros(1, 2, 1, 16), planes)
    assert torch.equal(zero_code[0, :, 0], pack_codes(torch.where(planes[:, -1] > 0, 1.0, -1.0)))


def test_sign_dot_products_are_hamming_distances():
    q, _, _ = qkv(n=20)
    signs = hash_signs(q, hash_planes(2, 16, 63, seed=1))
    codes = pack_codes(signs)
    xor = codes[..., :, None] ^ codes[..., None, :]
    popcount = unpack_bits(xor, 63).sum(-1)
    assert torch.equal((63 - signs @ signs.transpose(-1, -2)) / 2, popcount)


def test_planes_depend_only_on_the_seed():
    assert torch.equal(hash_planes(2, 16, 63, seed=5), hash_planes(2, 16, 63, seed=5))
    assert not torch.equal(hash_planes(2, 16, 63, seed=5), hash_planes(2, 16, 63, seed=6))


def test_kmeans_groups_identical_codes_and_leaves_padding_out():
    # Three distinct codes, each repeated: three clusters find them exactly.
    base = torch.tensor([[1.0] * 8, [-1.0] * 8, [1.0, -1.0] * 4])
    signs = base[torch.arange(30) % 3][None, None]  # (1, 1, 30, 8)
    mask = padding_mask(1, 30, [27])
    assign = hamming_kmeans(signs, mask, clusters=3, iterations=5, offsets=torch.tensor([0.5]))
    assert (assign[0, 0, 27:] == 3).all()
    real = assign[0, 0, :27]
    for r in range(3):
        assert len(set(real[r::3].tolist())) == 1
    assert len(set(real.tolist())) == 3


def test_empty_clusters_are_reseeded_from_the_farthest_queries():
    # All initial centroids land on copies of one code; re-seeding must spread them out.
    signs = torch.ones(1, 1, 16, 8)
    signs[0, 0, 12:] = -1  # four far-away queries at the end
    offsets = torch.tensor([0.0])
    no_iterations = hamming_kmeans(signs, torch.ones(1, 16, dtype=torch.bool), 3, 0, offsets)
    assert set(no_iterations[0, 0].tolist()) <= {0, 1, 2}
    assign = hamming_kmeans(signs, torch.ones(1, 16, dtype=torch.bool), 3, 3, offsets)
    far, near = set(assign[0, 0, 12:].tolist()), set(assign[0, 0, :12].tolist())
    assert len(far) == 1 and len(near) == 1 and far != near


def test_more_clusters_than_queries_gives_each_query_its_own():
    q, _, _ = qkv(n=12)
    mask = padding_mask(2, 12, [12, 7])
    assign = cluster_queries(REFERENCE, q, mask, AttentionSpec(clusters=10))
    assert set(assign[1, 0, :7].tolist()) == set(range(7))
    assert (assign[1, :, 7:] == 10).all()
    assert len(set(assign[0, 0].tolist())) <= 10


def test_refinement_lowers_the_clustering_cost():
    q, _, _ = qkv(b=1, h=2, n=64, structured=False)
    mask = torch.ones(1, 64, dtype=torch.bool)

    def cost(refine):
        assign = cluster_queries(REFERENCE, q, mask, AttentionSpec(clusters=6, refine=refine))
        total = 0.0
        for c in range(6):
            members = q[0][assign[0] == c]
            if len(members):
                total += ((members - members.mean(0)) ** 2).sum().item()
        return total

    assert cost(3) < cost(0)


def test_cluster_tiles_cover_every_real_query_once():
    assign = torch.tensor([[[2, 0, 2, 2, 1, 3, 2, 0, 2]]])  # 3 = padded (C = 3)
    positions, valid, tile_cluster = cluster_tiles(assign, clusters=3, tile=2)
    placed = positions[valid].tolist()
    assert sorted(placed) == [0, 1, 2, 3, 4, 6, 7, 8]
    for t in range(positions.shape[2]):
        members = positions[0, 0, t][valid[0, 0, t]]
        assert (assign[0, 0, members] == tile_cluster[0, 0, t]).all()


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize("method", APPROXIMATE)
def test_memory_is_linear_in_length(method):
    """No N x N tensor at 8k tokens: the largest tensor stays within a constant times N."""
    n, h = 8192, 2
    q, k, v = qkv(b=1, h=h, n=n, d=16, structured=False)
    spec = AttentionSpec(method=method, iterations=2, refine=1)
    with LargestTensor() as probe:
        out = attention(q, k, v, spec, backend="reference")
    assert torch.isfinite(out).all()
    assert probe.numel <= 256 * n * h, probe.numel  # N x N would be 32x that


def test_32k_tokens_run_on_cpu():
    q, k, v = qkv(b=1, h=1, n=32768, d=16, structured=False)
    for method in APPROXIMATE:
        out = attention(q, k, v, AttentionSpec(method=method, iterations=2, refine=1), backend="reference")
        assert out.shape == (1, 1, 32768, 16) and torch.isfinite(out).all()
