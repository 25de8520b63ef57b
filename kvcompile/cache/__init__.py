"""kvcompile.cache."""
