"""Parallelism across the data-parallel ranks of one instance."""
