"""The test files `make test` starts first (tests/conftest.py collects them first): about a
minute or more each on the 2-core dev box, longest first. Under two loadfile workers the short
files then fill in around them instead of one long file running alone at the end."""

LONGEST_FIRST = (
    "tests/kernels/test_clustered_triton.py",
    "tests/kernels/test_clustering_triton.py",
    "tests/kernels/test_centroid_triton.py",
    "tests/models/test_calibration_holdout.py",
    "tests/bench/gpu/test_gpu_speed.py",
    "tests/service/test_default_server.py",
    "tests/bench/costmodel/test_gpu_model.py",
    "tests/models/test_default_model_llamacpp.py",
    "tests/service/test_load.py",
    "tests/fuzz/test_schemathesis.py",
    "tests/test_wheel.py",
    "tests/kernels/test_smyrf_triton.py",
    "tests/kernels/test_matrix.py",
    "tests/kernels/test_banded.py",
    "tests/service/test_ollama_clients.py",
)
