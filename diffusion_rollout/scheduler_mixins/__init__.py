"""scheduler_mixins."""
