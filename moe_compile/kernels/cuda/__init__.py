"""Hand-written CUDA kernels, compiled at run time by NVRTC (see ``wgmma.py``)."""
