"""Shared-memory rings, arenas, eventfd wakeups and record layouts."""
