#!/usr/bin/env bash
# The first GPU session's one command: every GPU-side check in one table, under 8 minutes.
#   bench/gpu_day.sh [--port-base N] [--v4-dir DIR]       (extra flags go to bench.gpu_check)
# Runs `python -m bench.gpu_check --all` under a 480 s limit: kernels vs references and their
# timings, the trunk's exactness in bf16, the three services on the GPU (bundled model, TP = 2
# where two GPUs exist, the V4-Flash-shaped random checkpoint: 1 layer + the 3-stage drafter in
# 70 GB, written to --v4-dir, about 16 GB of disk) and the CUDA-only tests. Writes
# gpu_step_table.json and gpu_step_table-v4.json (the simulator's measured step tables) and
# gpu_check_logs/. Exit status: 0 all ok, 1 a check failed, 2 no CUDA device, 124 over time.
# The limit sends SIGINT, so the check stops the services it started (their `finally`) before
# it ends: a killed run must not leave `dspark serve` processes holding the GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
exec timeout --signal=INT --kill-after=30 480 "$PYTHON" -m bench.gpu_check --all "$@"
