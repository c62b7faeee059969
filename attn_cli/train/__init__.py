"""`attn train`: the loop, its processes, where a run starts, validation, the display."""
