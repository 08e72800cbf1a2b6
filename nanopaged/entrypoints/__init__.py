"""Command-line entry points (`nanopaged ...`, `python -m nanopaged ...`)."""
