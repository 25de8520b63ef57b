# Kernel tests run the Triton kernels through the interpreter when there is no GPU. Triton reads
# TRITON_INTERPRET when a kernel is decorated, so it must be set before kvcompile.kernels loads.
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
