"""clusterserve: long-document embeddings with clustered, improved clustered and SMYRF attention.

One import name for the whole project; the repository's top-level folders are its sub-packages:

    clusterserve.kernels   attention: spec, dispatch, reference / native / triton backends
    clusterserve.models    encoders, checkpoints, tokenization, pooling, the request plan
    clusterserve.service   the FastAPI server
    clusterserve.bench     benchmarks (installed with the package, never run by it)

Importing this package imports none of them.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("clusterserve")
except PackageNotFoundError:  # a checkout that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
