"""Small helpers that belong to no layer (ports, ...)."""
