"""Running the mixture for training: the DataLoader wrapper, worker transport, the device feed, rank sync, feedback."""
