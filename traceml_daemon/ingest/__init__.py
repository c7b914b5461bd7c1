"""The ingest pipeline: decode and check batches, stage them, write them in pipelined transactions, keep live aggregates."""
