"""`python -m pagedllm.kernels`: build (or find) the kernels now, e.g. at install time."""

from pagedllm.kernels.build import build_extension

print(build_extension())
