"""Triton kernels. Import lazily: triton is optional on CPU-only installs."""
