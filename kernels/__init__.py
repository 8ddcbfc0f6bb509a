"""Low-precision numerics: one folder per format, each Triton op beside its pure-PyTorch reference.

Dependency rule: this package imports only torch and triton (references import only torch).
"""
