"""The resume format as a small library that knows no mixer class: strict keys, compressed columns, reader snapshots,
worker rotation and sample locations."""
