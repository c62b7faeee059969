"""`attn serve`: the HTTP server and the queue that batches requests together."""
