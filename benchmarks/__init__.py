"""Benchmarks of the rollout server against the stock diffusers pipeline (see ``RESULTS.md``)."""
