"""The Triton backend (CUDA tensors; CPU tensors under TRITON_INTERPRET=1 in the tests): each
method's stages as Triton kernels, and the helpers they share (block sizes, grids)."""

from clusterserve.kernels.triton.interpreter import skip_dropped_work

skip_dropped_work()
