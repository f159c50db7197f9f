"""Speculative decoding's pure-Python parts: the proposers behind one Protocol
(``proposer.py``: n-gram prompt lookup, suffix decoding over recent requests) and the
configuration (``config.py``). The engine asks a proposer for drafts before each
schedule (``engine/speculator.py``); the scheduler reserves their slots, the runner
verifies them in one forward and the scheduler rolls rejected positions back
(``docs/design.md``, "Speculative decoding")."""
