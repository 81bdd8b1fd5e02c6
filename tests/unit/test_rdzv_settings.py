"""`--rdzv-conf` of the etcd-v3 backend: one parser for elastic-run's up-front check and for the
handler torch creates (stock torchrun), so both reject the same mistakes, naming the key."""

from __future__ import annotations

from datetime import timedelta

import pytest
from torch.distributed.elastic.rendezvous.api import RendezvousParameters

from elastic.rdzv_settings import KNOWN_KEYS, RendezvousSettings, parse_conf
from elastic.rendezvous import RendezvousConfig, validate_conf

pytestmark = pytest.mark.timeout(10)


def test_every_known_key_parses_into_typed_settings() -> None:
    settings = parse_conf({
        "node_id": "n0", "prefix": "jobs", "lease_ttl": "5", "join_timeout": "60", "last_call_timeout": "2.5",
        "etcd_timeout": 7, "cacert": "/ca.pem", "cert": "/c.pem", "key": "/k.pem", "user": "u",
        "password_file": "/pw", "join_token_file": "/token",
    })
    assert settings == RendezvousSettings(
        node_id="n0", prefix="jobs", lease_ttl=timedelta(seconds=5), join_timeout=timedelta(seconds=60),
        last_call_timeout=timedelta(seconds=2.5), etcd_timeout=timedelta(seconds=7), ca_cert="/ca.pem",
        cert="/c.pem", key="/k.pem", user="u", password_file="/pw", join_token_file="/token",
    )
    assert parse_conf({}) == RendezvousSettings()
    assert parse_conf({"ca_cert": "/ca.pem"}).ca_cert == "/ca.pem"
    assert KNOWN_KEYS == {"node_id", "prefix", "lease_ttl", "join_timeout", "last_call_timeout", "etcd_timeout",
                          "cacert", "ca_cert", "cert", "key", "user", "password", "password_file", "join_token_file"}


@pytest.mark.parametrize("key", ["lease_ttl", "join_timeout", "last_call_timeout", "etcd_timeout"])
@pytest.mark.parametrize("value", ["abc", "-1", "0", "inf", "-inf", "nan", "1e308", ""])
def test_bad_durations_are_refused_naming_key_and_value(key: str, value: str) -> None:
    with pytest.raises(ValueError) as err:
        validate_conf({key: value})
    assert f"{key}={value!r}" in str(err.value)


def test_lease_ttl_below_one_second_is_refused() -> None:
    with pytest.raises(ValueError, match=r"lease_ttl=0.5: must be at least 1 second"):
        parse_conf({"lease_ttl": "0.5"})


def test_unknown_key_lists_the_known_ones_and_suggests_the_close_one() -> None:
    with pytest.raises(ValueError) as err:
        validate_conf({"lease_tll": "5"})
    text = str(err.value)
    assert "'lease_tll'" in text and "did you mean lease_ttl?" in text
    for known in KNOWN_KEYS:
        assert known in text


def test_torchrun_timeout_key_is_refused_with_advice_but_dropped_when_torch_adds_it() -> None:
    with pytest.raises(ValueError, match="use join_timeout"):
        validate_conf({"timeout": "30"})
    # torch's LaunchConfig adds timeout=900 to every backend's config by itself.
    params = RendezvousParameters("etcd-v3", "127.0.0.1:2379", "run", 1, 1, timeout=900, join_timeout="5")
    assert RendezvousConfig.from_parameters(params).join_timeout == timedelta(seconds=5)


@pytest.mark.parametrize(
    ("conf", "match"),
    [
        ({"node_id": "a/b"}, "node_id='a/b'"),
        ({"prefix": "///"}, "prefix='///'"),
        ({"cert": "/c.pem"}, "cert= and key= go together"),
        ({"password": "x", "password_file": "/pw"}, "password= and password_file="),
        ({"cacert": "/a", "ca_cert": "/b"}, "ca_cert= repeats ca_cert="),
        ({"user": " "}, "user=' ': must be a non-empty string"),
    ],
)
def test_bad_values_are_refused_naming_the_key(conf: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match.replace("(", r"\(")):
        validate_conf(conf)


def test_handler_config_uses_the_same_parser_as_stock_torchrun_would() -> None:
    # Stock torchrun calls the registry's creator with these parameters; a typo must not be ignored.
    for bad, match in (
        ({"lease_tll": "5"}, "unknown key 'lease_tll'"),
        ({"etcd_timeout": "nan"}, "etcd_timeout='nan'"),
    ):
        params = RendezvousParameters("etcd-v3", "127.0.0.1:2379", "run", 1, 2, timeout=900, **bad)
        with pytest.raises(ValueError, match=f"^--rdzv-conf: {match}"):
            RendezvousConfig.from_parameters(params)
    params = RendezvousParameters("etcd-v3", "127.0.0.1:2379", "run", 1, 2, timeout=900, node_id="n1", lease_ttl="4",
                                  etcd_timeout="9", prefix="p")
    config = RendezvousConfig.from_parameters(params)
    assert (config.node_id, config.lease_ttl, config.etcd.retry_deadline, config.prefix) == (
        "n1", timedelta(seconds=4), timedelta(seconds=9), "p")
