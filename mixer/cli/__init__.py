"""The ``mixer`` command line and its demo data."""

from mixer.cli.commands import main

__all__ = ["main"]
