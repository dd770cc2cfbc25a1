"""Context parallelism: ranks, their calls and the sharding plans."""
