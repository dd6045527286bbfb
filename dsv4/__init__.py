"""Model math of DeepSeek-V4-Flash and its DSpark draft module (docs/model.md): config,
checkpoint layout, layers, trunk, draft module and their tensor parallelism. The package owns
what a forward computes and the state a sequence keeps; it never imports `services/` or gRPC
and never reads the process environment (settings arrive as `dsv4.settings.Settings`)."""
