"""pagedllm's test suite."""
