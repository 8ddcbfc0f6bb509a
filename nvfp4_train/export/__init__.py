"""Checkpoints out of and into the framework (docs/export.md).

- ``hf``: a training checkpoint (any TP/PP layout) as a Hugging Face Nemotron-H folder that
  ``transformers.NemotronHForCausalLM`` loads (:mod:`nvfp4_train.export.hf`, which also documents the exact
  mapping and where the two architectures differ).
- ``import-hf``: a Hugging Face Nemotron-H folder as a step-0 checkpoint ``train.py`` continues from.
- ``nvfp4``: the NVFP4-trained layers in NVIDIA ModelOpt's NVFP4 checkpoint layout (TensorRT-LLM, vLLM,
  SGLang), from the training's own scales (:mod:`nvfp4_train.export.nvfp4`).

Command line: ``python -m nvfp4_train.export {hf,import-hf,nvfp4} ...`` (``--help`` on each; exit status 0, 2 for
bad arguments or input, reported in one line, 4 for a file that cannot be read or written).
"""
