"""The generated protobuf/gRPC code is current with protos/ (tools/gen_protos.py --check), and
dspark.v1 stays wire compatible with its first release (fields are only ever added)."""

import subprocess
import sys
from pathlib import Path

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.descriptor import FieldDescriptor as F

from dspark_proto.v1 import gateway_pb2

ROOT = Path(__file__).resolve().parents[1]


def test_generated_code_matches_the_protos():
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_protos.py"), "--check"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr


def test_check_detects_a_stale_file(tmp_path, monkeypatch):
    """Copy the repo's protos + generated code, change a .proto, and --check must fail."""
    import shutil
    work = tmp_path / "repo"
    shutil.copytree(ROOT / "protos", work / "protos")
    shutil.copytree(ROOT / "dspark_proto", work / "dspark_proto")
    shutil.copytree(ROOT / "tools", work / "tools")
    proto = work / "protos" / "dspark_proto" / "v1" / "common.proto"
    proto.write_text(proto.read_text().replace("message InfoRequest {}", "message InfoRequest { int32 x = 1; }"))
    res = subprocess.run([sys.executable, str(work / "tools" / "gen_protos.py"), "--check"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "stale" in res.stderr


# ---------------------------------------------------------------------------- wire compatibility
# dspark.v1 as first released: every field's (number, type, repeated). Fields may be added to
# these messages, never renumbered, retyped or removed, so older clients and servers keep working.
V1_FIELDS = {
    "GenerateRequest": {"prompt": (1, F.TYPE_STRING, False), "prompt_token_ids": (2, F.TYPE_INT32, True),
                        "max_tokens": (3, F.TYPE_INT32, False), "temperature": (4, F.TYPE_FLOAT, False),
                        "spec": (5, F.TYPE_ENUM, False), "stop_token_ids": (6, F.TYPE_INT32, True),
                        "stop": (7, F.TYPE_STRING, True), "ignore_eos": (8, F.TYPE_BOOL, False),
                        "label": (9, F.TYPE_STRING, False)},
    "Usage": {"prompt_tokens": (1, F.TYPE_INT32, False), "completion_tokens": (2, F.TYPE_INT32, False)},
    "SpecStats": {name: (i, F.TYPE_DOUBLE if name in ("acceptance_rate", "mean_acceptance_length")
                         else F.TYPE_BOOL if name == "drafter_failed" else F.TYPE_INT32, False)
                  for i, name in enumerate(("rounds", "drafted", "submitted", "accepted", "acceptance_rate",
                                            "mean_acceptance_length", "margin_skipped_rounds", "truncated_rounds",
                                            "skipped_after_draft", "plain_rounds", "drafter_failed",
                                            "drafter_failovers"), start=1)},
    "GenerateResponse": {"token_ids": (1, F.TYPE_INT32, True), "text_delta": (2, F.TYPE_STRING, False),
                         "finished": (3, F.TYPE_BOOL, False), "finish_reason": (4, F.TYPE_STRING, False),
                         "usage": (5, F.TYPE_MESSAGE, False), "spec_stats": (6, F.TYPE_MESSAGE, False),
                         "text": (7, F.TYPE_STRING, False), "time_to_first_token_ms": (8, F.TYPE_DOUBLE, False)},
    "StatsRequest": {},
    "StatsResponse": {"json": (1, F.TYPE_STRING, False)},
}
V1_METHODS = {"Generate", "Stats"}


def test_v1_fields_keep_their_numbers_and_types():
    for message, fields in V1_FIELDS.items():
        desc = gateway_pb2.DESCRIPTOR.message_types_by_name[message]
        for name, (number, type_, repeated) in fields.items():
            f = desc.fields_by_name[name]
            assert (f.number, f.type, f.is_repeated) == (number, type_, repeated), f"{message}.{name}"
    methods = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].methods_by_name
    assert V1_METHODS <= set(methods)


def _v1_classes() -> dict:
    """Message classes of gateway.proto as released (the V1_FIELDS only), in a pool of their own."""
    file = descriptor_pb2.FileDescriptorProto()
    gateway_pb2.DESCRIPTOR.CopyToProto(file)
    file.name = "v1_gateway.proto"
    del file.dependency[:]  # v1 used nothing from common.proto; the fields that do are removed below
    for message in list(file.message_type):
        if message.name not in V1_FIELDS:
            file.message_type.remove(message)
            continue
        for field in list(message.field):
            if field.name not in V1_FIELDS[message.name]:
                message.field.remove(field)
        del message.oneof_decl[:]
    for method in list(file.service[0].method):
        if method.name not in V1_METHODS:
            file.service[0].method.remove(method)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return {name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"dspark.v1.{name}"))
            for name in V1_FIELDS}


def test_a_v1_client_reads_todays_final_message_and_keeps_the_new_fields():
    new = gateway_pb2.GenerateResponse(
        token_ids=[5, 6], text_delta="ab", finished=True, finish_reason="stop", text="xyab",
        usage=gateway_pb2.Usage(prompt_tokens=3, completion_tokens=4),
        spec_stats=gateway_pb2.SpecStats(rounds=2, submitted=5, accepted=3, acceptance_rate=0.6),
        time_to_first_token_ms=1.5, request_id="r-1", prompt_tokens=3, completion_tokens=4,
        matched_stop_str="\n\n", spec_draft_tokens=5, spec_accepted_tokens=3)
    old = _v1_classes()["GenerateResponse"].FromString(new.SerializeToString())
    assert (list(old.token_ids), old.text_delta, old.finished, old.finish_reason, old.text) == (
        [5, 6], "ab", True, "stop", "xyab")
    assert (old.usage.completion_tokens, old.spec_stats.submitted, old.spec_stats.accepted) == (4, 5, 3)
    assert old.time_to_first_token_ms == 1.5
    # unknown to the v1 client, yet carried through when it re-sends the message
    assert gateway_pb2.GenerateResponse.FromString(old.SerializeToString()) == new


def test_todays_gateway_reads_a_v1_request():
    v1 = _v1_classes()["GenerateRequest"](prompt="hi", max_tokens=7, stop=["x"], stop_token_ids=[9], label="w")
    new = gateway_pb2.GenerateRequest.FromString(v1.SerializeToString())
    assert (new.prompt, new.max_tokens, list(new.stop), list(new.stop_token_ids), new.label) == ("hi", 7, ["x"], [9], "w")
    assert new.request_id == ""  # the gateway then generates one


def test_every_proto_names_its_go_and_java_packages():
    """One Go package and one Java package for all of dspark.v1, one class per message, and an
    outer class per file that cannot clash with a message or service of the package."""
    from dspark_proto.v1 import common_pb2, drafter_pb2, verifier_pb2
    files = [m.DESCRIPTOR for m in (common_pb2, drafter_pb2, gateway_pb2, verifier_pb2)]
    options = [f.GetOptions() for f in files]
    names = {n for f in files for n in (*f.message_types_by_name, *f.services_by_name, *f.enum_types_by_name)}
    assert {o.go_package for o in options} == {"dspark-serving/gen/go/dspark/v1;dsparkv1"}
    assert {o.java_package for o in options} == {"io.dspark.v1"} and all(o.java_multiple_files for o in options)
    outer = [o.java_outer_classname for o in options]
    assert outer == ["CommonProto", "DrafterProto", "GatewayProto", "VerifierProto"] and not names & set(outer)
