"""The generated protobuf/gRPC code is current with protos/ (tools/gen_protos.py --check)."""

import subprocess
import sys
from pathlib import Path

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
