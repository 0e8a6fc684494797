"""The worker: the router<->worker contract (api), the Ray actor host, the base worker every pool
extends, the engine loop thread, the worker metrics, and the colocated worker. Nothing here
imports torch at package import."""
