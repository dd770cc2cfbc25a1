"""The engine core: requests to batches to pipeline calls to answers."""
