"""Offline analysis of the services' traces, the verifier's top-k dumps and the gateway's metrics (docs/analysis.md)."""
