"""kvcompile.engine."""
