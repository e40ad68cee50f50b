"""The CLI: one-line errors, and ``up`` stops cleanly on SIGINT and SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

NEXUSKV = [sys.executable, "-m", "streams.app.cli"]


def _run(args, **env):
    return subprocess.run(NEXUSKV + args, capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})


@pytest.mark.parametrize("url", ["foo://broker:9092", "kafka://no-port", "kafka://host:70000"])
def test_bad_broker_url_fails_with_one_line_naming_it(url):
    done = _run(["topics", "list"], NEXUSKV_BROKER=url)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "NEXUSKV_BROKER" in lines[0] and url in lines[0]


def test_unreachable_broker_fails_with_one_line():
    done = _run(["topics", "list"], NEXUSKV_BROKER="kafka://127.0.0.1:1", NEXUSKV_BROKER_START_TIMEOUT="1")
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == ["nexuskv: error: cannot reach broker kafka://127.0.0.1:1 within 1s"]


def test_config_table_masks_the_secret():
    done = _run(["config"], NEXUSKV_IDENTITY_SECRET="hunter2", NEXUSKV_BUS_SECRET="bus-hunter2-bus-hunter2",
                NEXUSKV_PUBLISHER_KEYS="p=" + "ab" * 32)
    assert done.returncode == 0 and "hunter2" not in done.stdout and "***" in done.stdout
    assert "abab" not in done.stdout
    md = _run(["config", "--markdown"])
    assert "| `NEXUSKV_BROKER` |" in md.stdout


def test_publisher_key_prints_a_kv_events_or_a_control_producers_key():
    from nexuskv.contracts.control_signature import producer_key
    from nexuskv.contracts.kv_signature import publisher_key

    secret = "bus-hunter2-bus-hunter2"
    kv = _run(["publisher-key", "vllm/a/dp0"], NEXUSKV_BUS_SECRET=secret)
    assert kv.returncode == 0 and kv.stdout.strip() == f"vllm/a/dp0={publisher_key(secret.encode(), 'vllm/a/dp0').hex()}"
    ctl = _run(["publisher-key", "--control", "executor/w0"], NEXUSKV_BUS_SECRET=secret)
    assert ctl.returncode == 0
    assert ctl.stdout.strip() == f"executor/w0={producer_key(secret.encode(), 'executor/w0').hex()}"


def _children(pid: int) -> set[int]:
    kids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    fields = fh.read().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                kids.add(int(entry))
    return kids


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.tansu
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_up_starts_and_stops_cleanly(sig, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "NEXUSKV_BROKER"}
    env["NEXUSKV_DATA_DIR"] = str(tmp_path)
    proc = subprocess.Popen(NEXUSKV + ["up"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if "Ctrl-C to stop" in line or not line:
                break
        assert any("topics ready" in line for line in lines), lines
        children = _children(proc.pid)
        assert children, "up started no broker process"
        proc.send_signal(sig)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(_gone(c) for c in children):
        time.sleep(0.1)
    assert all(_gone(c) for c in children), "a process outlived nexuskv up"


@pytest.mark.broker
def test_up_notices_a_dead_service_stops_the_rest_and_exits_non_zero(kafka_url, tmp_path):
    from streams.bus.process import free_port

    env = {**os.environ, "NEXUSKV_BROKER": str(kafka_url), "NEXUSKV_DATA_DIR": str(tmp_path),
           "NEXUSKV_INDEX_API_PORT": str(free_port())}
    proc = subprocess.Popen(NEXUSKV + ["up"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if "Ctrl-C to stop" in line or not line:
                break
        assert any("Ctrl-C to stop" in line for line in lines), lines
        children = _children(proc.pid)
        victim = next(c for c in children if "streams.calibration_agent" in open(f"/proc/{c}/cmdline").read())
        os.kill(victim, signal.SIGKILL)
        assert proc.wait(30) == 1
        out = proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "service calibration was killed by signal 9" in out, out
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(_gone(c) for c in children):
        time.sleep(0.1)
    assert all(_gone(c) for c in children), "a service outlived nexuskv up"


def test_descriptor_from_a_models_config_json(tmp_path):
    import json

    from nexuskv.descriptor import StateDescriptor
    from nexuskv.models import known_model

    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
        "intermediate_size": 14336, "rope_theta": 500000.0, "torch_dtype": "bfloat16"}))
    done = _run(["descriptor", str(tmp_path), "--model", "meta-llama/Llama-3.1-8B", "--block-size", "16"])
    assert done.returncode == 0, done.stderr
    d = StateDescriptor.model_validate_json(done.stdout)
    assert d.descriptor_id == known_model("meta-llama/Llama-3.1-8B").descriptor_id
    out = tmp_path / "d.json"
    done = _run(["descriptor", str(tmp_path / "config.json"), "--model", "m", "--block-size", "32", "--tenant", "acme",
                 "--layout", "paged_hn_kvd", "--out", str(out)])
    assert done.returncode == 0 and StateDescriptor.model_validate_json(out.read_text()).tenant_namespace == "acme"
    bad = _run(["descriptor", str(tmp_path), "--model", "m", "--block-size", "16", "--layout", "nope"])
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "nexuskv: error: layout: 'nope' is not one of paged_nhd, paged_hnd, paged_hn_kvd, paged_latent"]
