"""clusterserve's HTTP service: `create_app(settings)` builds the FastAPI app; `python -m service` runs it."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("clusterserve")
except PackageNotFoundError:  # running from a checkout that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["__version__"]
