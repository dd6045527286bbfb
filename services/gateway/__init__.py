"""The gateway service: client RPCs, the speculative scheduler, the confidence gate and the
round records they share. It loads no model: the verifier and the drafter are reached through
the sessions of `backends.py`."""
