"""API keys files: parsing, errors that name the line (never the key), reloading, and a
`spanserve serve` subprocess that takes a new key on SIGHUP, in every API server process."""
from __future__ import annotations

import logging
import signal
import time
from pathlib import Path

import httpx
import pytest

from spanserve import cli
from spanserve.server.keys import DEFAULT_TENANT, KeyRing, parse_keys
from test_server_harness import build_tiny_model, run_server

GOOD = """
# tenant key
alice  sk-alice-1
alice sk-alice-2
  bob	sk-bob-1

"""


def test_a_keys_file_maps_each_key_to_its_tenant() -> None:
    assert parse_keys(GOOD, "keys") == {"sk-alice-1": "alice", "sk-alice-2": "alice", "sk-bob-1": "bob"}


@pytest.mark.parametrize("text, says", [
    ("alice sk-1\nbob\n", "keys line 2: expected 'TENANT KEY' (two fields separated by spaces): a tenant name or a key "
                          "is missing"),
    ("alice sk-1 # the first\n", "keys line 1: expected 'TENANT KEY'"),
    ("alice sk-1\n\nbob sk-1\n", "keys line 3: this key is also on line 1"),
    ("al/ice sk-1\n", "keys line 1: the tenant name must be"),
    ("# nobody\n\n", "keys holds no keys"),
])
def test_bad_lines_are_errors_naming_the_line_and_never_the_key(text: str, says: str) -> None:
    with pytest.raises(ValueError) as e:
        parse_keys(text, "keys")
    assert says in str(e.value) and "sk-1" not in str(e.value)


def test_the_api_key_belongs_to_the_default_tenant_beside_the_file(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(GOOD)
    ring = KeyRing("sk-env", str(path))
    assert ring.tenant_of(b"sk-env") == DEFAULT_TENANT and ring.tenant_of(b"sk-bob-1") == "bob"
    assert ring.tenant_of(b"sk-bob-") is None and ring.tenant_of(b"") is None
    assert ring.tenants == {DEFAULT_TENANT, "alice", "bob"} and len(ring) == 4
    path.write_text("carol sk-env\n")
    with pytest.raises(ValueError, match="also in .*for another tenant"):
        KeyRing("sk-env", str(path))
    with pytest.raises(ValueError, match="cannot read the API keys file"):
        KeyRing(None, str(tmp_path / "missing"))


def test_reload_takes_a_good_file_and_keeps_the_keys_on_a_bad_one(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "keys"
    path.write_text(GOOD)
    ring = KeyRing(None, str(path))
    path.write_text("alice sk-alice-3\ncarol sk-carol-1\n")
    assert ring.reload()
    assert ring.tenant_of(b"sk-carol-1") == "carol" and ring.tenant_of(b"sk-alice-3") == "alice"
    assert ring.tenant_of(b"sk-alice-1") is None and ring.tenant_of(b"sk-bob-1") is None  # revoked
    path.write_text("alice sk-alice-3\ncarol sk-alice-3\n")
    with caplog.at_level(logging.ERROR, logger="spanserve.keys"):
        assert not ring.reload()
    assert "line 2" in caplog.text and "sk-alice-3" not in caplog.text
    assert ring.tenant_of(b"sk-carol-1") == "carol"  # the keys as they were
    path.unlink()
    assert not ring.reload() and ring.tenant_of(b"sk-alice-3") == "alice"


def test_a_bad_keys_file_stops_serve_before_the_model_loads(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "keys"
    path.write_text("alice sk-1\nbob\n")
    assert cli.main(["serve", "--model", str(tmp_path / "no-such-model"), "--api-keys-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert "line 2" in err and "sk-1" not in err


def _all_answer(url: str, key: str, tries: int = 16) -> bool:
    # a fresh connection each time: the kernel spreads them over the API server processes
    return all(httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 200
               for _ in range(tries))


def _none_answer(url: str, key: str, tries: int = 16) -> bool:
    return all(httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"}).status_code == 401
               for _ in range(tries))


def test_sighup_reloads_the_keys_of_every_api_server(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "tiny")
    keys = tmp_path / "keys"
    keys.write_text("alice sk-alice-1\n")
    with run_server(str(model), tmp_path, "--kv-cache-memory", "1MiB", "--block-size", "8", "--api-keys-file",
                    str(keys), "--api-server-count", "2") as srv:
        deadline = time.monotonic() + 60
        while "[api-1]: access" not in srv.log_text():  # the second API server is up
            assert time.monotonic() < deadline, srv.log_text()
            time.sleep(0.2)
        assert _all_answer(srv.url, "sk-alice-1") and _none_answer(srv.url, "sk-bob-1")
        assert httpx.get(f"{srv.url}/metrics").status_code == 401 and httpx.get(f"{srv.url}/health").status_code == 200
        keys.write_text("bob sk-bob-1\n")
        srv.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while not (_all_answer(srv.url, "sk-bob-1") and _none_answer(srv.url, "sk-alice-1")):
            assert time.monotonic() < deadline, srv.log_text()
            time.sleep(0.2)
        keys.write_text("bob\n")  # a bad file: the keys stay
        srv.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while srv.log_text().count("API keys not reloaded") < 2:
            assert time.monotonic() < deadline, srv.log_text()
            time.sleep(0.2)
        assert _all_answer(srv.url, "sk-bob-1") and srv.proc.poll() is None
        assert "sk-bob-1" not in srv.log_text() and "sk-alice-1" not in srv.log_text()
