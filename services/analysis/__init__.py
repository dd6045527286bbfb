"""Offline analysis of the services' traces and the verifier's top-k dumps (docs/analysis.md).

Owns reading what the services wrote (span files, top-k dumps) and the reports, cost fits,
verdicts and plots drawn from it; it never connects to a running service and never changes a
setting, it only prints what to set."""
