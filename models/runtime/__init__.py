"""Running an encoder: the Encoder (models.runtime.encoder), a packed batch's forward pass a
layer at a time, the packing itself, CUDA graphs of the layers, and the precision it runs in."""
