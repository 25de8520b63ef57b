"""kvcompile.passes."""
