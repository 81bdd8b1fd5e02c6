"""Run admission and secrets, the pure parts: the join-token proofs (HMAC-SHA256) of node records,
store addresses and the round state, where the token and the etcd password come from, and that
neither ever shows in a repr, a log line or an error message."""

from __future__ import annotations

import json
import logging
import os
from datetime import timedelta
from pathlib import Path

import pytest

from elastic.admission import TOKEN_ENV, Admission, load_join_token
from elastic.credentials import protect, read_secret_file, redact
from elastic.errors import AdmissionError
from elastic.etcd_client import PASSWORD_ENV, EtcdClientConfig, parse_endpoints, resolve_password
from elastic.keys import RunKeys, run_prefix
from elastic.rdzv_settings import parse_conf
from elastic.records import parse_run
from elastic.rendezvous import RendezvousConfig
from elastic.round import RoundState
from tests.unit.test_records import KV  # one key-value as a range read returns it

TOKEN = b"correct-horse-battery-staple-42"
RUN = "job-7"
KEYS = RunKeys(run_prefix("elastic-train", RUN))


def node_kv(admission: Admission, node_id: str, lease: int, **changes: object) -> KV:
    doc: dict[str, object] = {
        "node_id": node_id,
        "joined_at": 1.0,
        "addr": "10.0.0.1",
        "pid": 42,
        "beacon": "10.0.0.1:4000",
    }
    doc = admission.sign_node(doc, lease)
    doc.update(changes)
    return KV(KEYS.node(node_id).encode(), json.dumps(doc).encode(), lease=lease)


def state_kvs(admission: Admission, state: RoundState) -> list[KV]:
    """The state document and its MAC, as the handler writes them in one transaction (`RunStore.swap_state`)."""
    doc = state.to_json()
    kvs = [KV(KEYS.state.encode(), doc.encode())]
    for key, value in admission.state_puts(doc).items():
        kvs.append(KV(key.encode(), value.encode()))
    return kvs


def admitted(admission: Admission, kvs: list[KV]):  # noqa: ANN201 - RunRecords
    return admission.admit(parse_run(KEYS, kvs), kvs)


def test_a_registration_with_the_tokens_proof_is_admitted_and_any_change_to_it_is_not() -> None:
    mine = Admission(RUN, KEYS, TOKEN)
    good = node_kv(mine, "a", lease=7)
    assert set(admitted(mine, [good]).nodes) == {"a"}
    forged = [
        node_kv(mine, "b", lease=7, addr="10.6.6.6"),        # another address
        node_kv(mine, "c", lease=7, beacon="10.6.6.6:1"),   # another beacon
        node_kv(mine, "d", lease=7, pid=43),                 # another process
        node_kv(mine, "e", lease=7, proof="0" * 64),         # a made-up proof
        node_kv(Admission(RUN, KEYS, b"another-token-of-16-chars"), "f", lease=7),  # another token
        node_kv(Admission("job-8", KEYS, TOKEN), "g", lease=7),                       # another run's proof
        KV(KEYS.node("h").encode(), json.dumps({"node_id": "h", "addr": "10.0.0.1"}).encode(), lease=7),  # no proof
    ]
    # A good record copied under another lease (the owner died; a stranger re-puts its value).
    replayed = KV(good.key, good.value, lease=8)
    records = admitted(mine, [*forged])
    assert records.nodes == {}
    assert sorted(e.key for e in records.skipped) == sorted(kv.key.decode() for kv in forged)
    assert all("join token" in e.problem for e in records.skipped)
    assert admitted(mine, [replayed]).nodes == {}


def test_store_addresses_need_the_proof_of_their_round() -> None:
    mine = Admission(RUN, KEYS, TOKEN)
    good = KV(KEYS.store(3).encode(), json.dumps(mine.sign_store(3, "10.0.0.1", 29400)).encode())
    other_round = KV(KEYS.store(4).encode(), json.dumps(mine.sign_store(3, "10.0.0.1", 29400)).encode())
    redirected = KV(
        KEYS.store(5).encode(), json.dumps({**mine.sign_store(5, "10.0.0.1", 29400), "addr": "10.6.6.6"}).encode()
    )
    records = admitted(mine, [good, other_round, redirected])
    assert set(records.stores) == {3}
    assert {e.key for e in records.skipped} == {KEYS.store(4), KEYS.store(5)}


def test_a_round_state_without_the_runs_mac_is_an_error_naming_the_key() -> None:
    mine = Admission(RUN, KEYS, TOKEN)
    state = RoundState(generation=2, status="closed", participants=("a", "b"), acked=("a", "b"), nnodes=(1, 2))
    assert admitted(mine, state_kvs(mine, state)).state == state
    # A stranger adds itself: the document changes, the MAC no longer fits.
    doc, mac = state_kvs(mine, state)
    doc.value = (
        RoundState(generation=2, status="closed", participants=("a", "stranger"), nnodes=(1, 2)).to_json().encode()
    )
    for kvs in ([doc, mac], [doc], state_kvs(Admission(RUN, KEYS, b"another-token-of-16-chars"), state)):
        records = admitted(mine, kvs)
        assert records.state is None and records.state_error is not None
        assert records.state_error.key == KEYS.state and "not signed with this run's join token" in str(
            records.state_error
        )


def test_an_agent_without_the_token_cannot_read_a_run_that_requires_one() -> None:
    claimed = KV(Admission(RUN, KEYS, TOKEN).record_key.encode(), b'{"version": 1, "fingerprint": "00"}')
    with pytest.raises(
        AdmissionError, match=f"run '{RUN}' requires a join token; set \\${TOKEN_ENV} or --rdzv-conf join_token_file="
    ):
        admitted(Admission(RUN, KEYS, None), [claimed])
    # A run without a token is read as it is, strangers' records included: that is what no token trusts.
    plain = KV(KEYS.node("x").encode(), json.dumps({"node_id": "x", "addr": "h"}).encode(), lease=3)
    assert set(admitted(Admission(RUN, KEYS, None), [plain]).nodes) == {"x"}


def test_the_fingerprint_depends_on_token_and_run_and_reveals_neither() -> None:
    fp = Admission(RUN, KEYS, TOKEN).fingerprint()
    assert fp != Admission(RUN, KEYS, TOKEN + b"x").fingerprint() != Admission("job-8", KEYS, TOKEN).fingerprint()
    assert TOKEN.decode() not in fp and len(fp) == 64
    assert "correct-horse" not in repr(Admission(RUN, KEYS, TOKEN))


def test_join_token_comes_from_the_environment_or_a_file(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("file-token-0123456789abcdef\n")
    assert load_join_token(None, {TOKEN_ENV: " env-token-0123456789abcdef "}) == b"env-token-0123456789abcdef"
    assert load_join_token(str(token_file), {}) == b"file-token-0123456789abcdef"
    assert load_join_token(None, {}) is None and load_join_token(None, {TOKEN_ENV: ""}) is None
    with pytest.raises(ValueError, match="both join_token_file= and"):
        load_join_token(str(token_file), {TOKEN_ENV: "env-token-0123456789abcdef"})
    with pytest.raises(ValueError, match=rf"\${TOKEN_ENV} has 5 characters; use at least 16"):
        load_join_token(None, {TOKEN_ENV: "short"})


def test_bad_secret_files_are_refused_naming_key_and_path(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # opening a FIFO for reading would block for ever
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for path, why in [(tmp_path / "missing", "cannot open it"), (tmp_path, "not a regular file"),
                      (fifo, "not a regular file"), (empty, "the file is empty")]:
        with pytest.raises(ValueError, match=why) as info:
            read_secret_file(str(path), key="join_token_file")
        assert f"join_token_file={path}" in str(info.value)


def test_the_etcd_password_comes_from_a_file_the_environment_or_argv_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    secret = tmp_path / "pw"
    secret.write_text("from-the-file\n")
    with caplog.at_level(logging.WARNING, logger="elastic.etcd_client"):
        assert resolve_password("trainer", None, str(secret), {}) == "from-the-file"
        assert resolve_password("trainer", None, None, {PASSWORD_ENV: "from-the-env"}) == "from-the-env"
        assert not caplog.records
        assert resolve_password("trainer", "from-argv", None, {PASSWORD_ENV: "from-the-env"}) == "from-argv"
    assert "password= shows the etcd password to every user of this machine (ps" in caplog.text
    assert "from-argv" not in caplog.text
    with pytest.raises(ValueError, match="password= and password_file= contradict"):
        resolve_password("trainer", "x", str(secret), {})
    with pytest.raises(
        ValueError, match=f"user=trainer needs a password: pass --rdzv-conf password_file=PATH or set \\${PASSWORD_ENV}"
    ):
        resolve_password("trainer", None, None, {})
    with pytest.raises(ValueError, match="password_file= needs user="):
        resolve_password(None, None, str(secret), {})
    assert resolve_password(None, None, None, {PASSWORD_ENV: "stray"}) is None  # no user: not used (and warned)


def test_password_auth_over_plain_http_is_refused_and_tls_is_accepted(tmp_path: Path) -> None:
    for endpoints, ca in [("127.0.0.1:2379", None), ("http://a:2379,http://b:2379", None)]:
        with pytest.raises(
            ValueError,
            match="refusing to send the etcd password .* plain http .* use TLS, with https:// endpoints or "
                  "--rdzv-conf cacert=",
        ):
            EtcdClientConfig(endpoints=endpoints, ca_cert=ca, user="u", password="pw-never-sent")
    EtcdClientConfig(endpoints="https://a:2379", user="u", password="pw")
    ca = tmp_path / "ca.pem"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    EtcdClientConfig(endpoints="a:2379", ca_cert=str(ca), user="u", password="pw")
    # A client certificate is for TLS as well (it was silently not sent over plain http); a missing file is named.
    assert EtcdClientConfig(endpoints="a:2379", cert=str(ca), key=str(ca), user="u", password="pw").secure
    with pytest.raises(ValueError, match="cacert=/etc/etcd/missing.pem: not a readable file"):
        EtcdClientConfig(endpoints="a:2379", ca_cert="/etc/etcd/missing.pem")
    # IPv6 in brackets, kept for grpc; without them, refused (it parsed as host ":" port 1)
    assert parse_endpoints("[::1]:2379, https://[fe80::1]:2380") == (("[::1]", 2379, False), ("[fe80::1]", 2380, True))
    with pytest.raises(ValueError, match="brackets"):
        parse_endpoints("::1")
    # an unknown scheme and a ";" separator were told "an IPv6 address goes in brackets"
    with pytest.raises(ValueError, match=r"'etcd://127.0.0.1:2379': the scheme is http:// or https://"):
        parse_endpoints("etcd://127.0.0.1:2379")
    with pytest.raises(ValueError, match="separate endpoints with commas"):
        parse_endpoints("127.0.0.1:2379;127.0.0.1:2380")


def test_no_repr_shows_the_password_or_the_token(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    monkeypatch.setenv(TOKEN_ENV, "token-0123456789abcdef")
    params = RendezvousParameters(backend="etcd-v3", endpoint="https://127.0.0.1:2379", run_id=RUN, min_nodes=1,
                                  max_nodes=2, user="u", password="hunter2-argv", node_id="n")
    config = RendezvousConfig.from_parameters(params)
    assert config.etcd.password == "hunter2-argv" and config.join_token == b"token-0123456789abcdef"
    for text in (repr(config), repr(config.etcd), repr(parse_conf({"user": "u", "password": "hunter2-argv"}))):
        assert "hunter2" not in text and "token-0123" not in text


def test_protected_secrets_are_masked_in_log_lines_and_messages(caplog: pytest.LogCaptureFixture) -> None:
    protect("s3cr3t-in-a-log")
    protect("abc")  # too short to mask usefully: left alone
    log = logging.getLogger("some.library")
    with caplog.at_level(logging.INFO):
        log.info("connecting with %s", {"password": "s3cr3t-in-a-log"})
        try:
            raise RuntimeError("auth failed for s3cr3t-in-a-log")
        except RuntimeError:
            log.exception("boom")
    assert (
        "s3cr3t-in-a-log" not in caplog.text
        and "auth failed for ***" in caplog.text
        and "{'password': '***'}" in caplog.text
    )
    assert redact("pw=s3cr3t-in-a-log; abc") == "pw=***; abc"


def test_a_rendezvous_config_binds_to_local_addr_only_when_given() -> None:
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    common = dict(backend="etcd-v3", endpoint="127.0.0.1:2379", run_id=RUN, min_nodes=1, max_nodes=1)
    assert (
        RendezvousConfig.from_parameters(RendezvousParameters(**common, local_addr="10.1.2.3")).bind_addr == "10.1.2.3"
    )
    unset = RendezvousConfig.from_parameters(RendezvousParameters(**common))
    assert unset.bind_addr is None and unset.local_addr  # advertised: the FQDN, as before
    assert unset.lease_ttl == timedelta(seconds=3)


@pytest.mark.filterwarnings("ignore:Unable to enable fault handler")  # torch's @record under capsys
def test_a_bad_rdzv_conf_is_echoed_with_the_password_masked(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from elastic.launcher import cli

    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(SystemExit) as exited:
        cli(["--nnodes", "1", "--rdzv-endpoint", "127.0.0.1:1", "--rdzv-id", "x",
             "--rdzv-conf", "user=u,password=hunter2-typo,junk", str(script)])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "--rdzv-conf 'user=u,password=***,junk'" in err and "hunter2" not in err
