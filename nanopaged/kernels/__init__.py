"""Paged-attention kernels: each file holds a Triton body, a typed launcher and a torch reference."""
