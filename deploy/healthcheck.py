"""Container health check: `python healthcheck.py HOST:PORT [SERVICE]` exits 0 when the
grpc.health.v1 status of SERVICE ("" = the server as a whole) is SERVING, 1 otherwise.

Meant for the plaintext health port (DSPARK_HEALTH_PORT), so it needs no certificate even
when the service port requires mTLS. Used by deploy/compose.yaml; Kubernetes uses its native
`grpc:` probes on the same port instead.
"""

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print("usage: healthcheck.py HOST:PORT [SERVICE]", file=sys.stderr)
        return 2
    service = argv[2] if len(argv) == 3 else ""
    with grpc.insecure_channel(argv[1]) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=3)
        except grpc.RpcError as e:
            print(f"{argv[1]} {service!r}: {e.code().name}", file=sys.stderr)
            return 1
    serving = reply.status == health_pb2.HealthCheckResponse.SERVING
    if not serving:
        print(f"{argv[1]} {service!r}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}",
              file=sys.stderr)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
