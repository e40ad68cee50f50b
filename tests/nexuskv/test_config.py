from pathlib import Path

import pytest

from nexuskv.config import Settings, parse_broker_url, setting_rows
from nexuskv.errors import ConfigError


@pytest.mark.parametrize(
    ("url", "hosts"),
    [
        ("kafka://127.0.0.1:9092", (("127.0.0.1", 9092),)),
        ("kafka://a:1,b:2/", (("a", 1), ("b", 2))),
        ("kafka://[::1]:9092", (("::1", 9092),)),
    ],
)
def test_good_broker_urls(url, hosts):
    parsed = parse_broker_url(url)
    assert parsed.hosts == hosts
    assert parsed.bootstrap_servers == ",".join(f"{h}:{p}" for h, p in hosts)


@pytest.mark.parametrize("url", ["", "127.0.0.1:9092", "http://a:1", "kafka://", "kafka://a", "kafka://a:0",
                                 "kafka://a:99999", "kafka://a:x", "kafka://a b:1", "kafka://a:1,,b:2"])
def test_bad_broker_urls_name_the_setting_and_the_url(url):
    with pytest.raises(ConfigError) as info:
        parse_broker_url(url)
    assert info.value.field == "NEXUSKV_BROKER"
    assert repr(url) in str(info.value)
    assert "\n" not in str(info.value)


def test_settings_from_env_and_errors_name_the_variable():
    s = Settings.from_env({"NEXUSKV_BROKER": "kafka://h:1", "NEXUSKV_TOPIC_PARTITIONS": "3",
                           "NEXUSKV_DATA_DIR": "/tmp/x", "NEXUSKV_LOG_LEVEL": "debug"})
    assert s.broker_url.hosts == (("h", 1),) and s.topic_partitions == 3 and s.data_dir == Path("/tmp/x")
    assert s.log_level == "DEBUG"
    assert Settings.from_env({}).broker is None and Settings.from_env({"NEXUSKV_BROKER": " "}).broker is None
    assert not Settings.from_env({}).kv_event_tokens  # token ids stay off the bus unless asked for
    assert Settings.from_env({"NEXUSKV_KV_EVENTS_TOKENS": "on"}).kv_event_tokens
    for env, var in [({"NEXUSKV_TOPIC_PARTITIONS": "zero"}, "NEXUSKV_TOPIC_PARTITIONS"),
                     ({"NEXUSKV_TOPIC_PARTITIONS": "0"}, "NEXUSKV_TOPIC_PARTITIONS"),
                     ({"NEXUSKV_BROKER": "nope"}, "NEXUSKV_BROKER"),
                     ({"NEXUSKV_LOG_LEVEL": "loud"}, "NEXUSKV_LOG_LEVEL"),
                     ({"NEXUSKV_IDENTITY_SECRET": "x" * 65}, "NEXUSKV_IDENTITY_SECRET"),
                     ({"NEXUSKV_KV_EVENTS_TOKENS": "yes"}, "NEXUSKV_KV_EVENTS_TOKENS")]:
        with pytest.raises(ConfigError) as info:
            Settings.from_env(env)
        assert info.value.field == var
        assert str(info.value).startswith(var)


def test_every_setting_has_an_env_name_and_a_doc_and_the_readme_lists_it():
    rows = setting_rows()
    assert len({r[0] for r in rows}) == len(rows) == len(Settings.model_fields)
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    for var, _default, doc in rows:
        assert var.startswith("NEXUSKV_") and doc
        assert f"`{var}`" in readme, f"README's configuration table lacks {var}"


def test_index_api_tokens_parse_and_bad_ones_name_the_variable_without_echoing_them():
    from nexuskv.config import parse_api_tokens

    s = Settings.from_env({"NEXUSKV_INDEX_API_TOKENS": "a" * 16 + "=acme, " + "b" * 20 + "=globex",
                           "NEXUSKV_IDENTITY_SECRET": "s" * 16, "NEXUSKV_BUS_SECRET": "b" * 16})
    assert s.api_tokens == {"a" * 16: "acme", "b" * 20: "globex"}
    assert Settings.from_env({}).api_tokens == {} and parse_api_tokens("") == {}
    for bad in ("short=acme", "x" * 16, "y" * 16 + "="):
        with pytest.raises(ConfigError) as info:
            Settings.from_env({"NEXUSKV_INDEX_API_TOKENS": bad})
        assert info.value.field == "NEXUSKV_INDEX_API_TOKENS" and bad.split("=")[0] not in str(info.value)


def test_a_deployment_with_more_than_one_tenant_refuses_to_start_without_an_identity_secret():
    two = "a" * 16 + "=acme," + "b" * 16 + "=globex"
    for secret in (None, "", "short-secret"):
        env = {"NEXUSKV_INDEX_API_TOKENS": two}
        if secret is not None:
            env["NEXUSKV_IDENTITY_SECRET"] = secret
        with pytest.raises(ConfigError) as info:
            Settings.from_env(env)
        assert info.value.field == "NEXUSKV_IDENTITY_SECRET" and "2 tenants" in str(info.value)
        assert "a" * 16 not in str(info.value) and (not secret or secret not in str(info.value))
    assert Settings.from_env({"NEXUSKV_INDEX_API_TOKENS": two, "NEXUSKV_IDENTITY_SECRET": "x" * 16,
                              "NEXUSKV_BUS_SECRET": "b" * 16}).api_tokens
    one = "a" * 16 + "=acme," + "b" * 16 + "=acme"  # one tenant, two tokens: nobody to probe
    assert Settings.from_env({"NEXUSKV_INDEX_API_TOKENS": one}).identity_secret == ""


def test_a_deployment_with_more_than_one_tenant_refuses_to_start_without_a_bus_secret():
    # Without one, anyone who can write to the bus sends placement hints and transfer commands that
    # evict and move another tenant's state (issue 23).
    two = "a" * 16 + "=acme," + "b" * 16 + "=globex"
    with pytest.raises(ConfigError) as info:
        Settings.from_env({"NEXUSKV_INDEX_API_TOKENS": two, "NEXUSKV_IDENTITY_SECRET": "x" * 16})
    assert info.value.field == "NEXUSKV_BUS_SECRET" and "2 tenants" in str(info.value)
    assert "a" * 16 not in str(info.value)
    s = Settings.from_env({"NEXUSKV_INDEX_API_TOKENS": two, "NEXUSKV_IDENTITY_SECRET": "x" * 16,
                           "NEXUSKV_BUS_SECRET": "b" * 16})
    assert s.bus_secret_bytes == b"b" * 16
    one = "a" * 16 + "=acme," + "b" * 16 + "=acme"
    assert Settings.from_env({"NEXUSKV_INDEX_API_TOKENS": one}).bus_secret == ""


def test_control_and_hint_bounds_are_validated():
    s = Settings.from_env({})
    assert (s.control_max_age_s, s.tier_prefetch_fraction, s.tier_prefetch_max_s) == (300.0, 0.25, 60.0)
    for var, bad in (("NEXUSKV_CONTROL_MAX_AGE", "0"), ("NEXUSKV_TIER_PREFETCH_FRACTION", "1.5"),
                     ("NEXUSKV_TIER_PREFETCH_FRACTION", "0"), ("NEXUSKV_TIER_PREFETCH_MAX", "-1")):
        with pytest.raises(ConfigError) as info:
            Settings.from_env({var: bad})
        assert info.value.field == var


def test_bus_secret_and_publisher_keys_are_checked_and_never_echoed():
    from nexuskv.config import parse_publisher_keys

    with pytest.raises(ConfigError) as info:
        Settings.from_env({"NEXUSKV_BUS_SECRET": "tooshort"})
    assert info.value.field == "NEXUSKV_BUS_SECRET" and "tooshort" not in str(info.value)
    key = "ab" * 32
    assert parse_publisher_keys(f"vllm/10.0.0.5:8000/dp0={key}") == {"vllm/10.0.0.5:8000/dp0": bytes.fromhex(key)}
    for bad in (f"={key}", "p=zz", "p=abcd", "p"):
        with pytest.raises(ConfigError) as info:
            Settings.from_env({"NEXUSKV_PUBLISHER_KEYS": bad})
        assert info.value.field == "NEXUSKV_PUBLISHER_KEYS" and key not in str(info.value)
