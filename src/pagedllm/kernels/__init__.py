"""pagedllm's C++ CPU kernels: the build, the CPU feature probe and the ops.

Every kernel lives under ``csrc/``; ``build`` compiles them into one library loaded into
``torch.ops.pagedllm``; ``ops`` wraps the non-attention ops with their torch fallbacks.
The attention backend (``attention/cpu.py``) and the model's fast path call them.
"""
