"""Triton kernels with torch reference implementations."""
