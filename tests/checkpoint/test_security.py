"""CURVE on checkpoint sockets: the cluster key file, and a secure holder that serves peers
with the cluster's keys while refusing (and counting) every other peer."""

from __future__ import annotations

import dataclasses
import os
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from lumend.checkpoint.security import ENV_VAR, CurveKeys, KeyFileError, client_keys_from_env
from lumend.checkpoint.streamer import CheckpointStreamer

from .conftest import MakeHolder, RunningHolder, block_hash, page

MakeStreamer = Callable[..., CheckpointStreamer]


def stream(s: CheckpointStreamer, ckpt: str, blocks: int) -> bool:
    """Put `blocks` pages; True when every one was sent and ACKed."""
    sent = [s.put_block(ckpt_id=ckpt, request_id=ckpt, worker="w0", block_index=i,
                        block_hash=block_hash(ckpt, i), page=page(i), token_count=16 * (i + 1))
            for i in range(blocks)]
    return all(sent) and s.wait_acks(ckpt, 10).complete


def unauthenticated(holder: RunningHolder) -> int:
    return holder.stats().bad_frames["unauthenticated"]


def wait_for(predicate: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


# -- the holder ---------------------------------------------------------------------------


@pytest.fixture
def keys() -> CurveKeys:
    return CurveKeys.generate()


@pytest.fixture
def secure_holder(make_holder: MakeHolder, keys: CurveKeys) -> RunningHolder:
    return make_holder(curve=keys)


def test_a_peer_with_the_cluster_keys_is_served(secure_holder: RunningHolder, keys: CurveKeys,
                                                make_streamer: MakeStreamer) -> None:
    s = make_streamer(secure_holder.endpoint, curve=keys)
    assert stream(s, "c1", 3)
    assert s.lookup("c1", [block_hash("c1", i) for i in range(3)]) == 3
    fetched = s.get("c1", block_hash("c1", 1))
    assert fetched is not None and bytes(fetched.data) == page(1)
    assert unauthenticated(secure_holder) == 0


@pytest.mark.parametrize("intruder", ["another client key pair", "no CURVE",
                                      "another server key"])
def test_peers_without_the_cluster_keys_are_refused_and_counted(
    secure_holder: RunningHolder, keys: CurveKeys, make_streamer: MakeStreamer, intruder: str,
) -> None:
    other = CurveKeys.generate()
    curve = {
        "another client key pair": dataclasses.replace(
            keys, client_public=other.client_public, client_secret=other.client_secret),
        "no CURVE": None,
        "another server key": dataclasses.replace(keys, server_public=other.server_public),
    }[intruder]
    good = make_streamer(secure_holder.endpoint, curve=keys)
    bad = make_streamer(secure_holder.endpoint, curve=curve, connect=False)

    assert not bad.wait_connected(1.0), "the holder let the intruder connect"
    assert not any(bad.put_block(ckpt_id="evil", request_id="evil", worker="w0",
                                 block_index=i, block_hash=block_hash("evil", i), page=page(i),
                                 token_count=16) for i in range(3))
    assert bad.progress["evil"].dropped == 3
    assert bad.lookup("c1", [block_hash("c1", 0)], timeout_s=0.3) is None
    wait_for(lambda: unauthenticated(secure_holder) >= 1, "the refusal to be counted")

    # The good peer, connected the whole time, keeps being served, and nothing of the
    # intruder reached the store.
    assert stream(good, "c1", 4)
    assert good.lookup("c1", [block_hash("c1", i) for i in range(4)]) == 4
    assert good.lookup("evil", [block_hash("evil", 0)]) == 0
    assert secure_holder.stats().workers["w0"].requests == 1


def test_an_insecure_holder_counts_no_refusals(holder: RunningHolder,
                                               make_streamer: MakeStreamer) -> None:
    """Control for the counter: without keys the same plain peer is simply served."""
    s = make_streamer(holder.endpoint)
    assert stream(s, "c1", 2)
    assert unauthenticated(holder) == 0


def test_two_secure_holders_in_one_process(make_holder: MakeHolder, keys: CurveKeys,
                                           make_streamer: MakeStreamer) -> None:
    """Each secure holder has its own ZeroMQ context, so each has its own ZAP handler."""
    first, second = make_holder(curve=keys), make_holder(curve=keys)
    for h in (first, second):
        assert stream(make_streamer(h.endpoint, curve=keys), "c1", 2)


# -- the key file -------------------------------------------------------------------------


def test_key_file_round_trip_is_private(tmp_path: Path, keys: CurveKeys) -> None:
    path = tmp_path / "checkpoint.keys"
    keys.write(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert CurveKeys.load(path) == keys
    with pytest.raises(FileExistsError):
        CurveKeys.generate().write(path)
    path.chmod(0o644)
    fresh = CurveKeys.generate()
    fresh.write(path, force=True)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and CurveKeys.load(path) == fresh


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660])
def test_a_key_file_others_can_read_is_refused(tmp_path: Path, keys: CurveKeys,
                                               mode: int) -> None:
    path = tmp_path / "checkpoint.keys"
    keys.write(path)
    path.chmod(mode)
    with pytest.raises(KeyFileError) as caught:
        CurveKeys.load(path)
    assert str(path) in str(caught.value) and f"chmod 600 {path}" in str(caught.value)


def rewrite(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o600)
    return path


@pytest.mark.parametrize(("change", "expected"), [
    (lambda t: "not = [toml", "is not TOML"),
    (lambda t: t.replace("client_secret", "# client_secret"), "client_secret is missing"),
    (lambda t: t + 'extra = "x"\n', "unknown key 'extra'"),
    (lambda t: t.replace('server_public = "', 'server_public = "~'), "server_public is not a "
     "CURVE key"),
])
def test_key_file_format_errors_name_the_problem(tmp_path: Path, keys: CurveKeys,
                                                 change: Callable[[str], str],
                                                 expected: str) -> None:
    path = tmp_path / "checkpoint.keys"
    keys.write(path)
    rewrite(path, change(path.read_text()))
    with pytest.raises(KeyFileError) as caught:
        CurveKeys.load(path)
    assert str(path) in str(caught.value) and expected in str(caught.value)


def test_a_public_key_from_another_pair_is_refused(tmp_path: Path, keys: CurveKeys) -> None:
    path = tmp_path / "checkpoint.keys"
    dataclasses.replace(keys, client_public=CurveKeys.generate().client_public).write(path)
    with pytest.raises(KeyFileError, match="client_public does not belong to client_secret"):
        CurveKeys.load(path)


def test_a_missing_key_file_says_how_to_make_one(tmp_path: Path) -> None:
    path = tmp_path / "nope.keys"
    with pytest.raises(KeyFileError) as caught:
        CurveKeys.load(path)
    assert f"lumenctl keys generate {path}" in str(caught.value)


def test_client_keys_from_the_environment(tmp_path: Path, keys: CurveKeys) -> None:
    path = tmp_path / "checkpoint.keys"
    keys.write(path)
    assert client_keys_from_env({}) is None
    assert client_keys_from_env({ENV_VAR: ""}) is None
    assert client_keys_from_env({ENV_VAR: str(path)}) == keys
    path.chmod(0o644)
    with pytest.raises(KeyFileError, match=f"{ENV_VAR}={path}: .*chmod 600"):
        client_keys_from_env({ENV_VAR: str(path)})


# -- lumenctl keys generate ---------------------------------------------------------------


def lumenctl(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "LUMEN_CONFIG"}
    return subprocess.run([sys.executable, "-m", "lumenctl", *args], capture_output=True,
                          text=True, timeout=60, env=env)


def test_lumenctl_keys_generate(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.keys"
    made = lumenctl("keys", "generate", str(path))
    assert made.returncode == 0, made.stderr
    assert str(path) in made.stdout
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    first = CurveKeys.load(path)

    again = lumenctl("keys", "generate", str(path))
    assert again.returncode == 1
    assert "already exists" in again.stderr and "--force" in again.stderr
    assert CurveKeys.load(path) == first  # untouched

    forced = lumenctl("keys", "generate", "--force", str(path))
    assert forced.returncode == 0, forced.stderr
    assert CurveKeys.load(path) != first

    nowhere = lumenctl("keys", "generate", str(tmp_path / "no" / "such" / "dir" / "k"))
    assert nowhere.returncode == 1 and "cannot write" in nowhere.stderr
