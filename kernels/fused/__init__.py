"""Fused elementwise kernels of the training step, each beside its pure-PyTorch reference."""
