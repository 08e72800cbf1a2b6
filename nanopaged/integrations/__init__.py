"""Adapters that run nanopaged under other frameworks (optional extras)."""
