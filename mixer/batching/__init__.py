"""Level 2: length buckets and packing under a token budget, collate into one flat buffer, the batch types."""
