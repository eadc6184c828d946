"""The CPU backend: C++ kernels for XLA:CPU, built on first use (build.py), by family:
quantized and bf16 matmuls (matmul.py), paged attention (attention.py), and the packed weight
layouts they read (panels.py)."""
