"""Device kernels: plain-torch building blocks here, Triton kernels under ``triton/``."""
