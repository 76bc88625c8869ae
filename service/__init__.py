"""clusterserve's HTTP service: `create_app(settings)` builds the FastAPI app; `clusterserve serve`
(or `python -m clusterserve.service`) runs it."""

from clusterserve import __version__

__all__ = ["__version__"]
