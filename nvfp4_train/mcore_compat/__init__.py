"""Every megatron-core / torch workaround, each with the version it is for."""
