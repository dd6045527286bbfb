"""OpenAI-compatible HTTP front of the gateway (`/v1/completions`, `/v1/chat/completions`, SSE).

It runs in the gateway process on its own port (`DSPARK_HTTP_PORT`, `--http-port`) and turns
each choice of an HTTP request (a prompt of a batch, one of `n`) into one `Gateway.Generate`
call over a real gRPC channel to the gateway's own port, so HTTP and gRPC clients get the same
tokens, usage and errors. See
docs/services.md, "HTTP API".
"""
