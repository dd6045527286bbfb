"""gRPC server reflection under both protocol versions, `grpc.reflection.v1` and `v1alpha`.

Owns the reflection service of every dspark server. grpcio-reflection (up to 1.85.1, the pin)
serves only `grpc.reflection.v1alpha.ServerReflection`, while current clients (grpc-go
and grpc-java's reflection clients, Postman, newer grpcurl, buf curl) ask `grpc.reflection.v1`
first, and some ask nothing else. The v1 protocol is v1alpha promoted: the same messages with the
same field numbers and types, under the package `grpc.reflection.v1`. So one stock v1alpha
servicer answers both: its method is registered a second time under the v1 service name, with
the v1alpha (de)serializers, which read and write v1's bytes unchanged. The v1 descriptor
(`grpc/reflection/v1/reflection.proto`, derived from v1alpha's by renaming the package) is added
to the default pool, so reflection describes the v1 service too.
"""

from __future__ import annotations

from typing import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.descriptor import FileDescriptor
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1ALPHA_PACKAGE = "grpc.reflection.v1alpha"
V1_PACKAGE = "grpc.reflection.v1"
V1_FILE = "grpc/reflection/v1/reflection.proto"
V1ALPHA_SERVICE_NAME = reflection.SERVICE_NAME
V1_SERVICE_NAME = f"{V1_PACKAGE}.ServerReflection"
SERVICE_NAMES = (V1_SERVICE_NAME, V1ALPHA_SERVICE_NAME)


def _renamed(type_name: str) -> str:
    """A fully qualified type name of v1alpha (".grpc.reflection.v1alpha.X") in v1's package."""
    prefix = f".{V1ALPHA_PACKAGE}."
    return f".{V1_PACKAGE}.{type_name[len(prefix):]}" if type_name.startswith(prefix) else type_name


def _rename_messages(messages) -> None:
    for message in messages:
        for f in message.field:
            if f.HasField("type_name"):  # scalars have none; setting "" would mark one present
                f.type_name = _renamed(f.type_name)
        _rename_messages(message.nested_type)


def v1_file_descriptor() -> FileDescriptor:
    """The `grpc.reflection.v1` file descriptor in the default pool (added on first call).

    Its messages and service are v1alpha's field for field, renamed into the v1 package; the
    options (v1alpha's `deprecated`, Java and Go packages) are dropped.
    """
    pool = descriptor_pool.Default()
    try:
        return pool.FindFileByName(V1_FILE)
    except KeyError:
        pass
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = V1_FILE, V1_PACKAGE
    proto.ClearField("options")
    _rename_messages(proto.message_type)
    for service in proto.service:
        for method in service.method:
            method.input_type, method.output_type = _renamed(method.input_type), _renamed(method.output_type)
    pool.AddSerializedFile(proto.SerializeToString())
    return pool.FindFileByName(V1_FILE)


def enable_reflection(service_names: Iterable[str], server: grpc.aio.Server) -> tuple[str, ...]:
    """Serve reflection v1 and v1alpha on `server`, listing `service_names` and both reflection
    services; returns the names listed (sorted). The services' descriptors must be in the
    default pool (importing their generated `*_pb2` modules ensures it)."""
    v1_file_descriptor()
    names = tuple(sorted({*service_names, *SERVICE_NAMES}))
    servicer = reflection.aio.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    v1 = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(V1_SERVICE_NAME,
                                                                          {"ServerReflectionInfo": v1}),))
    return names
