"""[gateway] drain_s and log_admissions, and `lumend check-config` on model paths (a real
process each)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lumend.config import ConfigError, parse_config

from .test_config import config_text, worker


def test_drain_s_default_zero_and_bounds() -> None:
    assert parse_config(config_text()).gateway.drain_s == 30.0
    assert parse_config(config_text(gateway={"drain_s": 0})).gateway.drain_s == 0.0
    for bad in (-1, 7200):
        with pytest.raises(ConfigError) as caught:
            parse_config(config_text(gateway={"drain_s": bad}))
        [problem] = caught.value.problems
        assert problem.key == "gateway.drain_s" and "TimeoutStopSec" in problem.fix
    with pytest.raises(ConfigError) as caught:
        parse_config(config_text(gateway={"drain_s": "soon"}))
    assert "a number" in caught.value.problems[0].fix


def test_log_admissions_is_off_by_default_and_a_boolean() -> None:
    assert parse_config(config_text()).gateway.log_admissions is False
    on = parse_config(config_text(gateway={"log_admissions": True}))
    assert on.gateway.log_admissions is True
    with pytest.raises(ConfigError) as caught:
        parse_config(config_text(gateway={"log_admissions": "yes"}))
    [problem] = caught.value.problems
    assert problem.key == "gateway.log_admissions" and "true or false" in str(caught.value)


def test_pool_wait_s_default_and_bounds() -> None:
    assert parse_config(config_text()).gateway.pool_wait_s == 5.0
    assert parse_config(config_text(gateway={"pool_wait_s": 0.5})).gateway.pool_wait_s == 0.5
    for bad in (0, -1):
        with pytest.raises(ConfigError) as caught:
            parse_config(config_text(gateway={"pool_wait_s": bad}))
        [problem] = caught.value.problems
        assert problem.key == "gateway.pool_wait_s" and "pool_wait_s = 5" in problem.fix


def test_admit_deadline_s_default_bounds_and_the_link_it_sets() -> None:
    """[gateway] admit_deadline_s: 0.5 s by default; the gateway's coordinator link waits
    that long for an admission and twice as long for a recovery (slow links between nodes
    would otherwise send every admission of a remote gateway down the local path)."""
    from lumend.rpc.plane import link_timing

    assert parse_config(config_text()).gateway.admit_deadline_s == 0.5
    config = parse_config(config_text(gateway={"admit_deadline_s": 2.5}))
    timing = link_timing(config)
    assert (timing.admit_deadline_s, timing.recover_deadline_s) == (2.5, 5.0)
    assert timing.coordinator_wait_s == config.etcd.lease_ttl_s + 2.0
    for bad in (0, -1, "soon"):
        with pytest.raises(ConfigError) as caught:
            parse_config(config_text(gateway={"admit_deadline_s": bad}))
        [problem] = caught.value.problems
        assert problem.key == "gateway.admit_deadline_s" and "admit_deadline_s = 0.5" in \
            problem.fix


def test_shadow_wait_s_default_and_bounds() -> None:
    assert parse_config(config_text()).gateway.shadow_wait_s == 1.0
    assert parse_config(config_text(gateway={"shadow_wait_s": 8})).gateway.shadow_wait_s == 8
    for bad in (0, -2):
        with pytest.raises(ConfigError) as caught:
            parse_config(config_text(gateway={"shadow_wait_s": bad}))
        [problem] = caught.value.problems
        assert problem.key == "gateway.shadow_wait_s" and "shadow_wait_s = 1" in problem.fix


def check_config(tmp_path: Path, model: str, *flags: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "lumend.toml"
    path.write_text(config_text(workers=[worker(engine="vllm", model=model)]))
    return subprocess.run([sys.executable, "-m", "lumend", "check-config", *flags, str(path)],
                          capture_output=True, text=True, timeout=60)


def test_check_config_reports_a_missing_model_path_and_strict_fails(tmp_path: Path) -> None:
    missing = str(tmp_path / "models" / "Qwen3-8B")
    loose = check_config(tmp_path, missing)
    assert loose.returncode == 0, loose.stderr
    assert f"model = '{missing}': no such file or directory" in loose.stderr
    strict = check_config(tmp_path, missing, "--strict")
    assert strict.returncode == 2
    assert "error:" in strict.stderr and "copy the model there" in strict.stderr

    # The same path once the weights are there: no word about the model.
    Path(missing).mkdir(parents=True)
    empty = check_config(tmp_path, missing)
    assert "holds no weight files" in empty.stderr
    (Path(missing) / "model-00001-of-00002.safetensors").write_bytes(b"\0")
    present = check_config(tmp_path, missing)
    assert missing not in present.stderr, present.stderr

    # A hub id is not a path: not checked.
    hub = check_config(tmp_path, "Qwen/Qwen3-8B")
    assert "Qwen/Qwen3-8B" not in hub.stderr


@pytest.mark.skipif(os.getuid() == 0, reason="root reads every file")
def test_check_config_reports_an_unreadable_model(tmp_path: Path) -> None:
    model = tmp_path / "private"
    model.mkdir()
    (model / "w.safetensors").write_bytes(b"\0")
    model.chmod(0o000)
    try:
        result = check_config(tmp_path, str(model))
    finally:
        model.chmod(0o755)
    assert "cannot read it" in result.stderr


def test_check_config_warns_about_models_under_home(tmp_path: Path) -> None:
    result = check_config(tmp_path, "/home/someone/models/Qwen3-8B")
    assert "ProtectHome=yes" in result.stderr
