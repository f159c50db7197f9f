"""The worker: the only place block ids become tensors."""
