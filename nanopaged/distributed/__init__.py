"""Tensor parallelism: the rank's share of a model, its collectives, and the worker processes."""
