"""Small helpers vLLM scripts import by name (vllm.utils, vllm.utils.argparse_utils)."""

from nanopaged.utils.argparse_utils import FlexibleArgumentParser

__all__ = ["FlexibleArgumentParser"]
