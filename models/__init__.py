"""The hybrid Mamba-Transformer: pattern, sizes, specs, mixer, builder.

Importing ``nvfp4_train.models`` stays light (no torch, no megatron-core): the pattern and the size configs are plain
data. Import the builder and the layers from their own modules.
"""
