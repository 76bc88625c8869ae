"""The reference backend: each method's stages in PyTorch (any device, any float dtype), the
definition the native and Triton backends are tested against; exact attention, local
attention, the encoders' rotary positions (rotary.py) and the masks and hashing the methods
share."""
