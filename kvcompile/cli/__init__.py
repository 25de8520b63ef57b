"""kvcompile.cli."""
