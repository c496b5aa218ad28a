"""The ``mixer`` command line and its demo data."""

from mixer.cli.commands import build_parser, main

__all__ = ["build_parser", "main"]
