"""Session-wide test setup.

Without CUDA the Triton kernels run under Triton's interpreter. The interpreter flag must be set
before triton is first imported, and many tests import it indirectly (Inductor, the experts
registry), so it is set here, once, for the whole session.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
