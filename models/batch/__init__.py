"""A packed batch as the networks run it: its layout (packing) and a pass in progress (passes)."""
