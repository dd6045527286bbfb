"""Device placement of the verifier and the drafter: `--device` / DSPARK_DEVICE parsing and
errors, the start-up refusal of a device the machine lacks, and the CPU path through the new
plumbing giving today's bits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dsv4.checkpoint import load_drafter_weights, load_trunk_weights
from dsv4.dspark import DSparkDraft
from dsv4.sampling import SamplingParams
from dsv4.trunk import Trunk
from services import app, cli
from services.common.device import DeviceUnavailable, check_available, default_dtype, to_host, to_pinned
from services.common.settings import BackendSettings, parse_device
from services.settings import backend_settings, read_settings
from services.verifier.batcher import StepVerifier

BUNDLED = Path(__file__).resolve().parents[1] / "assets" / "dspark-small"
HAS_CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("raw,canonical", [("cpu", "cpu"), ("cuda", "cuda:0"), ("cuda:0", "cuda:0"),
                                           ("cuda:7", "cuda:7"), (" cuda:1 ", "cuda:1")])
def test_device_spellings(raw, canonical):
    assert parse_device(raw) == canonical


@pytest.mark.parametrize("raw", ["", "gpu", "CUDA", "cuda:", "cuda:-1", "cuda:1x", "mps", "cuda:1234", "cpu:0"])
def test_bad_device_spellings_are_named(raw):
    with pytest.raises(ValueError, match=r"--device=.*must be cpu, cuda or cuda:N"):
        parse_device(raw)


def test_flag_wins_over_the_variable_and_the_variable_over_the_default():
    assert backend_settings({}).device == "cpu"
    assert backend_settings({"DSPARK_DEVICE": "cuda"}).device == "cuda:0"
    assert backend_settings({"DSPARK_DEVICE": "cuda:3"}, "cpu").device == "cpu"
    with pytest.raises(ValueError, match="DSPARK_DEVICE='tpu'"):
        backend_settings({"DSPARK_DEVICE": "tpu"})
    with pytest.raises(ValueError, match="--device='cuda:x'"):
        read_settings({}, "drafter", device_flag="cuda:x")
    with pytest.raises(ValueError, match="device='cuda'"):
        BackendSettings(device="cuda")  # the typed object holds the canonical spelling only


def test_default_dtype_is_bf16_on_a_gpu_and_fp32_on_the_cpu():
    assert default_dtype("cuda:0") == torch.bfloat16
    assert default_dtype("cpu") == torch.float32


@pytest.mark.skipif(HAS_CUDA, reason="CUDA is present: the missing-device refusal needs a machine without it")
@pytest.mark.parametrize("service", ["verifier", "drafter"])
def test_serve_on_a_missing_gpu_fails_at_once_naming_the_device(service, capsys):
    assert cli.main(["serve", service, "--device", "cuda:1", "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"dspark serve {service}: device cuda:1: CUDA is not available on this machine "
                   "(use --device cpu)"]
    with pytest.raises(DeviceUnavailable, match="device cuda:0"):
        check_available("cuda:0")


def test_a_second_gpu_with_triton_kernels_is_refused_before_the_device_check(capsys, monkeypatch):
    monkeypatch.setenv("DSV4_KERNELS", "triton")
    assert cli.main(["serve", "verifier", "--device", "cuda:1", "--port", "0"]) == 2
    assert "device cuda:1 with DSV4_KERNELS=triton" in capsys.readouterr().err


def test_serve_gateway_refuses_a_device(capsys):
    assert cli.main(["serve", "gateway", "--device", "cpu", "--port", "0"]) == 2
    assert "--device=cpu: the gateway runs no model" in capsys.readouterr().err


def test_to_host_leaves_cpu_tensors_alone():
    t = torch.arange(6.0).reshape(2, 3)
    assert to_host(t) is t


def test_rows_bound_for_the_cpu_are_not_pinned():
    """Only a CUDA-bound commit is staged in page-locked memory (a CPU drafter copies nothing)."""
    t = torch.arange(6.0).reshape(2, 3)
    assert to_pinned(t, torch.device("cpu")) is t


def _run(engine, prompt: list[int], steps: int, params: SamplingParams):
    """(tokens, rows of every call) of a prefill then `steps` decodes on a fresh session, through
    the step loop (`StepVerifier`: a batch of one)."""
    sid = engine.open_session()
    res = engine.prefill(sid, prompt, params)
    tokens, rows = [res.next_token], [res.rows]
    for i in range(steps):
        res = engine.decode(sid, tokens[-1], len(prompt) + i)
        tokens.append(res.next_token)
        rows.append(res.rows)
    return tokens, rows


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.9, seed=5)])
def test_cpu_verifier_through_the_device_path_equals_the_host_loader_bitwise(params):
    """The served path (parsed device, its default dtype, shard reads onto the device) against
    the loader as it was before devices: the checkpoint read on the host, an fp32 Trunk."""
    device = parse_device("cpu")
    new = StepVerifier(app.verifier_engine(app.load_trunk(BUNDLED, device=device, dtype=default_dtype(device)),
                                           BackendSettings()))
    cfg, weights = load_trunk_weights(BUNDLED)
    trunk = Trunk(cfg)
    trunk.load_weights(weights)
    old = StepVerifier(app.verifier_engine(trunk, BackendSettings()))
    prompt = [5, 17, 99, 3, 42, 8]
    try:
        got, want = _run(new, prompt, 4, params), _run(old, prompt, 4, params)
    finally:
        new.close()
        old.close()
    assert got[0] == want[0]
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))


def test_cpu_drafter_through_the_device_path_equals_the_host_loader_bitwise():
    device = parse_device("cpu")
    """The served drafter (streamed one tensor at a time onto the device) against the whole
    logical dict read on the host and loaded at once."""
    new = app.load_drafter(BUNDLED, device=device, dtype=default_dtype(device)).state_dict()
    cfg, weights, conf = load_drafter_weights(BUNDLED)
    module = DSparkDraft(cfg, confidence_head=conf)
    module.load_weights(weights)
    old = module.state_dict()
    assert new.keys() == old.keys()
    assert all(new[k].device.type == "cpu" and torch.equal(new[k], old[k]) for k in old)
