"""The model: where its files are, loading, and our own forward pass over the paged KV cache."""
