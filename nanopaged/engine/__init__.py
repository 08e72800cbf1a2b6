"""Scheduling and memory management: sequences, blocks, batches, the model runner."""
