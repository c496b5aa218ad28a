"""YAML and NeMo-style configuration to the same dataclasses the Python API takes."""
