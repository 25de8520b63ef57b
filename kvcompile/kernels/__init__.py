"""kvcompile.kernels."""
