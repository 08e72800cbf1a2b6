"""The llguidance import, with the install hint when the `structured` extra is missing."""

from __future__ import annotations

try:
    import llguidance
    import llguidance.hf
except ImportError as e:  # the extra is optional: only requests with structured_outputs need it
    raise ImportError(
        "structured outputs need the llguidance package: pip install 'nanopaged[structured]'"
    ) from e

__all__ = ["llguidance"]
