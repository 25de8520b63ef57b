"""kvcompile.eviction."""
