"""mixer: mix WebDataset sources by token share into length-bucketed token-budget batches."""
