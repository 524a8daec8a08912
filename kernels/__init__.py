"""Attention kernels: Triton for CUDA, C for the CPU, each with a torch reference."""
