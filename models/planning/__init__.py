"""Deciding what runs before anything runs: a call's inputs checked and tokenized, each
sequence's attention resolved once (plan, chunk_plan, chunking), its estimated work (cost) and
the calibration tables `auto` chooses from."""
