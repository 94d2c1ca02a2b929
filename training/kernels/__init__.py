"""Fused kernels for the training step on CUDA, each checked against the plain path it replaces.

- :mod:`training.kernels.linear_ce`: the LM head and the next-token cross-entropy in one pass that never
  materializes the ``[tokens × vocab]`` logits (Liger Kernel's fused linear cross-entropy on CUDA when it is
  importable, a chunked pure-torch implementation otherwise).
- :mod:`training.kernels.liger`: Liger Kernel's fused RMSNorm, SwiGLU and RoPE patched into the student's
  modules by model type, on CUDA only.

Liger Kernel is an optional extra (``pip install '.[gpu]'``: Triton kernels, CUDA only); nothing here
imports it unless the device is CUDA. Attention has its own module (``training.attention``).
"""
