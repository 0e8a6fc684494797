"""The paged KV cache as bookkeeping (mechanism, not policy): blocks, reference counts and prefix
hashes, the host swap pool and the copies in and out of it, and the pool's capacity from the
model's shape."""
