"""Code the three services share: settings types, session tables and session loop, server
bootstrap, telemetry, tensors on the wire, TLS. Nothing here imports the gateway, verifier or
drafter packages, so each of them may import it."""
