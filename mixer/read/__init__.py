"""Tar byte streams to samples: the tar walk, decoding of tokens and fields, sample construction and counters."""
