"""Placeholder."""
EXTRA_FAMILIES = ()
