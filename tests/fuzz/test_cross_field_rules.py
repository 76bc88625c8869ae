"""`make fuzz`'s hooks keep only bodies the server accepts: every chunking object that
`keeps_cross_field_rules` lets through plans without error on the plumbing model and on the
served default (its prompt adds to the framing), over a grid around each rule's edges."""

import itertools

import pytest
from cross_field import keeps_cross_field_rules

from clusterserve.kernels import AttentionSpec
from clusterserve.models.planning.chunk_plan import plan_chunks
from clusterserve.service.planning import chunking_spec
from clusterserve.service.schemas import ChunkingRequest

TEXT = "One sentence of a document. " * 40
GRID = dict(
    size=[None, 1, 2, 100, 256, 496, 497, 8000],
    overlap=[None, 0, 1, 99, 100, 255, 256, 495],
    window=[None, 1, 16, 17, 100, 512],
    window_overlap=[None, 0, 100, 480, 495, 496],
    late=[None, True, False],
)


def kept_bodies():
    for values in itertools.product(*GRID.values()):
        chunking = {name: value for name, value in zip(GRID, values) if value is not None}
        if keeps_cross_field_rules({"input": TEXT, "chunking": chunking}):
            yield chunking


@pytest.fixture(scope="module", params=["minilm", "nomic"])
def encoder(request):
    from clusterserve.models import load_encoder

    if request.param == "nomic":
        from default_model import require_default_model

        require_default_model()
        return load_encoder(None)
    return load_encoder("all-MiniLM-L6-v2", max_input_tokens=512)  # the shortest limit served


def test_every_body_the_hooks_keep_is_accepted(encoder):
    kept = 0
    for chunking in kept_bodies():
        spec = chunking_spec(ChunkingRequest(**chunking), late_inputs=False)
        plan_chunks(encoder, [TEXT], AttentionSpec(method="full"), spec)  # raises on a refused body
        kept += 1
    assert kept > 100  # the grid reaches past each rule's edge, and most of it is kept


def test_the_hooks_drop_what_breaks_a_rule():
    assert not keeps_cross_field_rules({"attention": {"bits": 0, "iterations": 99}})
    assert not keeps_cross_field_rules({"attention": {"method": "clustered", "bits": 0, "iterations": 1}})
    assert keeps_cross_field_rules({"attention": {"method": "smyrf", "bits": 0, "iterations": 1}})  # reads no bits
    assert keeps_cross_field_rules({"attention": {"iterations": 5}})  # bits left out: 63
    assert not keeps_cross_field_rules({"attention": {"method": "full", "target_fidelity": 0.9}})
    assert not keeps_cross_field_rules({"attention": {"target_fidelity": 0.9, "clusters": 10}})
    assert keeps_cross_field_rules({"attention": {"target_fidelity": 0.9, "seed": 3}})
    assert not keeps_cross_field_rules({"late_chunking": True, "chunking": {"size": 10}})
    assert keeps_cross_field_rules({"late_chunking": True, "chunking": {"window": 400}})
    assert not keeps_cross_field_rules({"chunking": {"size": 10, "overlap": 10}})
    assert not keeps_cross_field_rules({"chunking": {"size": 10.0, "overlap": 10.0}})  # JSON's 10.0 is 10
    assert not keeps_cross_field_rules({"attention": {"bits": 0.0, "iterations": 2.0}})
    assert not keeps_cross_field_rules({"chunking": {"overlap": 256}})  # the default size
    assert not keeps_cross_field_rules({"chunking": {"window": 16}})
    assert not keeps_cross_field_rules({"chunking": {"window": 100, "window_overlap": 90}})
    assert not keeps_cross_field_rules({"chunking": {"late": False, "size": 8000}})
    assert keeps_cross_field_rules({"inputs": "no chunking"})
