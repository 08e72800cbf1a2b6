"""Paged-attention kernels: each file holds a Triton body, its launcher and a torch reference."""
