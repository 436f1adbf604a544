"""Placeholder until the family lands (replaced in this change)."""
