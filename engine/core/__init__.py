"""Torch-free control plane: requests, KV block manager, scheduler and policies."""
