"""One-off investigations: scripts that answered one question once (where a call's time goes, why
two forwards part, what a profile shows), kept so their RESULTS rows and journal entries can be
re-run and checked.

What belongs here: a diagnosis, a trace, a breakdown or a comparison made to explain a figure or
chase a regression, which nobody re-runs to get a number they rely on. What does not: a benchmark a
user re-runs for a RESULTS row that stands for the project's speed, exactness or reliability (the
modules in ``benchmarks/``). A script here uses the same plumbing as those (``benchmarks.report``,
``benchmarks.timing``, ``benchmarks.model_builders``), and runs as
``python -m benchmarks.investigations.NAME``.
"""
