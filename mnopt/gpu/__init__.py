"""The GPU pieces: CUDA stack diagnosis, device helpers, kernels.
Layer 1 (gpu) of docs/architecture.md.
"""
