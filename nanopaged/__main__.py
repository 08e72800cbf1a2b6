"""`python -m nanopaged run-batch ...`: the same commands as the `nanopaged` script."""

from nanopaged.entrypoints.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
