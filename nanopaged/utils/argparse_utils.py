"""The argument parser vLLM's example scripts build their command lines with."""

from __future__ import annotations

import argparse
import sys


class FlexibleArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser that also takes --flag_name for --flag-name (vLLM's)."""

    def parse_known_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        fixed = []
        for arg in args:
            name, eq, value = arg.partition("=")
            if name.startswith("--") and "_" in name:
                arg = name.replace("_", "-") + eq + value
            fixed.append(arg)
        return super().parse_known_args(fixed, namespace)
