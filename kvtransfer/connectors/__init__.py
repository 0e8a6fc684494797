"""KV connectors: one class per data path between a prefill worker's pool and a decode
worker's, each registered by name (registry.py) behind one interface (base.py).

Built in: zmq_frames.py (frames over the socket; every pair), shm_in_place.py and
cuda_ipc_in_place.py (the sender writes the receiver's pool itself, under its grant fence),
dist_pair.py (a torch.distributed pair, gloo or NCCL).

A new transport is one file here (a KVConnector with its SendPath and ReceivePath) and one
`register_connector` line in registry.py: `--kv-transport NAME` offers it, the handshake
asks for it, and both sides move its rows. (Torch-free: the router reads the registry.)
"""
