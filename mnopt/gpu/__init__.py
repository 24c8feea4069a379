"""The GPU pieces: CUDA stack diagnosis, device helpers, kernels."""
