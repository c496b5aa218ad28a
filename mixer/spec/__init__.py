"""What a user declares: sources and batching budgets (configuration only, no I/O)."""
