"""One reader's view of one source: shuffle buffer, cursor, source-epochs and re-reads on restore."""
