"""The typed Celery messages between control plane and node (kcaas/node_protocol/messages.py): every message round-trips
through its keyword arguments, and anything that is not exactly one message of this version is refused, naming the
field, before either side acts on it."""

import dataclasses
import json

import pytest

from kcaas.node_protocol import messages as nm

SPEC = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "block_size": 16, "dtype": "float16"}
SAMPLES = {
    nm.ProvisionCache: dict(
        cache_id="c",
        spec=SPEC,
        capacity={"device": 1 << 20, "ssd": 0, "network": 1 << 30},
        hash_key_box="kcs1.x",
        epoch=1,
        tenant_id="t",
        ssd_key_box="kcs1.y",
        network_write_through=True,
    ),
    nm.DetachCache: dict(cache_id="c", epoch=3, forget_network=True),
    nm.RevokeTokens: dict(entries=[{"jti": "j", "exp": 1700000000}]),
    nm.PurgeTenant: dict(tenant_id="t", job_id="job"),
    nm.MigrateIn: dict(
        migration_id="m",
        cache_id="c",
        spec=SPEC,
        capacity={"device": 1},
        hash_key_box="kcs1.x",
        epoch_to=2,
        source_node_id="n1",
        tenant_id="t",
        ssd_key_box="",
        network_write_through=False,
    ),
    nm.MigrateOut: dict(
        migration_id="m",
        cache_id="c",
        epoch_from=1,
        epoch_to=2,
        target_node_id="n2",
        target_migration_endpoint="h:1",
        target_endpoint="h:2",
    ),
    nm.MigrateCutover: dict(migration_id="m", cache_id="c", epoch_from=1, target_endpoint="h:2", epoch_to=2),
    nm.MigrateAbort: dict(migration_id="m", cache_id="c"),
    nm.ProvisionResult: dict(cache_id="c", node_id="n", ok=True, reason="", endpoint="h:1"),
    nm.DetachResult: dict(cache_id="c", node_id="n"),
    nm.PurgeResult: dict(job_id="job", node_id="n", tenant_id="t", purged=[{"cache_id": "c", "freed_bytes": 5}]),
    nm.MigrationProgress: dict(migration_id="m", node_id="n", phase="copying", info={"blocks": 3, "x": None}),
    nm.MigrationResult: dict(migration_id="m", node_id="n", ok=False, reason="r", info={}),
}


def test_every_message_has_a_sample_and_a_unique_task():
    assert set(SAMPLES) == set(nm.ORDERS) | set(nm.ANSWERS)
    assert len(nm.MESSAGES) == len(SAMPLES)
    for kind in SAMPLES:
        assert nm.message_class(kind.TASK) is kind


@pytest.mark.parametrize("kind", list(SAMPLES), ids=lambda kind: kind.__name__)
def test_a_message_round_trips_through_json_keyword_arguments(kind):
    message = kind(**SAMPLES[kind])
    wire = json.loads(json.dumps(message.to_dict()))  # what the broker carries
    assert wire["v"] == kind.VERSION and set(wire) == {"v", *kind.field_names()}
    assert kind.from_call((), wire) == message


@pytest.mark.parametrize("kind", list(SAMPLES), ids=lambda kind: kind.__name__)
def test_positional_missing_unknown_and_versioned_calls_are_refused_naming_the_field(kind):
    good = kind(**SAMPLES[kind]).to_dict()
    first = kind.field_names()[0]
    with pytest.raises(nm.MessageError, match="positional"):
        kind.from_call(list(SAMPLES[kind].values()), {})
    with pytest.raises(nm.MessageError) as missing:
        kind.from_dict({k: v for k, v in good.items() if k != first})
    assert missing.value.field == first and "missing" in str(missing.value)
    with pytest.raises(nm.MessageError) as unknown:
        kind.from_dict({**good, "surprise": 1})
    assert unknown.value.field == "surprise"
    for version in (None, 0, kind.VERSION + 1, str(kind.VERSION), True):
        with pytest.raises(nm.MessageError) as versioned:
            kind.from_dict({**good, "v": version})
        assert versioned.value.field == "v"
    with pytest.raises(nm.MessageError):
        kind.from_dict({k: v for k, v in good.items() if k != "v"})
    with pytest.raises(nm.MessageError):
        kind.from_dict([good])


@pytest.mark.parametrize(
    "kind, field, bad",
    [
        (nm.ProvisionCache, "epoch", 0),
        (nm.ProvisionCache, "epoch", True),  # a bool is not an integer
        (nm.ProvisionCache, "epoch", "1"),
        (nm.ProvisionCache, "cache_id", ""),
        (nm.ProvisionCache, "cache_id", 7),
        (nm.ProvisionCache, "capacity", {"hbm": 1}),
        (nm.ProvisionCache, "capacity", {"device": -1}),
        (nm.ProvisionCache, "spec", []),
        (nm.ProvisionCache, "hash_key_box", None),
        (nm.ProvisionCache, "network_write_through", 1),
        (nm.ProvisionCache, "network_write_through", None),
        (nm.ProvisionCache, "capacity", {"network": -1}),
        (nm.MigrateIn, "network_write_through", "yes"),
        (nm.ProvisionResult, "ok", 1),
        (nm.MigrationProgress, "phase", "done"),
        (nm.MigrationProgress, "info", {"nested": {"a": 1}}),
        (nm.RevokeTokens, "entries", [{"jti": "j"}]),
        (nm.RevokeTokens, "entries", [{"jti": "j", "exp": "soon"}]),
        (nm.PurgeResult, "purged", [{"cache_id": "c", "freed_bytes": -1}]),
        (nm.PurgeResult, "purged", {"cache_id": "c"}),
    ],
)
def test_a_mistyped_field_is_refused_on_both_sides(kind, field, bad):
    with pytest.raises(nm.MessageError) as built:  # the sender cannot build it
        kind(**{**SAMPLES[kind], field: bad})
    assert built.value.field == field and built.value.task == kind.TASK
    with pytest.raises(nm.MessageError) as parsed:  # nor can the receiver be handed it
        kind.from_dict({**kind(**SAMPLES[kind]).to_dict(), field: bad})
    assert parsed.value.field == field


def test_the_error_names_the_field_never_its_value():
    secret = "kcs1.secret-box-contents"
    with pytest.raises(nm.MessageError) as error:
        nm.ProvisionCache.from_dict(
            {**nm.ProvisionCache(**SAMPLES[nm.ProvisionCache]).to_dict(), "epoch": secret, "hash_key_box": secret}
        )
    assert secret not in str(error.value)


def test_to_dict_copies_so_a_sent_message_cannot_be_changed_through_it():
    message = nm.ProvisionCache(**SAMPLES[nm.ProvisionCache])
    sent = message.to_dict()
    sent["capacity"]["device"] = 0
    assert message.capacity["device"] == 1 << 20
    with pytest.raises(dataclasses.FrozenInstanceError):
        message.epoch = 2  # type: ignore[misc]


def test_an_unknown_task_is_no_message():
    with pytest.raises(nm.MessageError, match="not a control/node task"):
        nm.message_class("kcaas.node.reboot")


@pytest.mark.parametrize(
    "kind, field",
    [
        (nm.ProvisionCache, "network_write_through"),
        (nm.MigrateIn, "network_write_through"),
        (nm.DetachCache, "forget_network"),
    ],
    ids=lambda kind: getattr(kind, "__name__", kind),
)
def test_a_version_1_order_still_parses_without_the_network_field_which_means_false(kind, field):
    """An order written before the network tier (an outbox row, a redelivery) has v 1 and no network field
    (network_write_through, forget_network): it reads as False; a version-1 order that carries the field is refused
    (v1 had no such field)."""
    assert kind.VERSION == 2
    v1 = {key: value for key, value in kind(**SAMPLES[kind]).to_dict().items() if key != field}
    v1["v"] = 1
    message = kind.from_call((), json.loads(json.dumps(v1)))
    assert getattr(message, field) is False
    assert message.to_dict()["v"] == 2  # re-sent, it is a message of this version
    with pytest.raises(nm.MessageError) as carried:
        kind.from_dict({**v1, field: True})
    assert carried.value.field == field
    with pytest.raises(nm.MessageError) as missing:  # version 2 must carry it
        kind.from_dict({**v1, "v": 2})
    assert missing.value.field == field


def test_network_is_a_message_tier_and_not_a_node_tier():
    assert nm.TIERS == ("device", "dram", "ssd", "network")
    assert nm.NODE_TIERS == ("device", "dram", "ssd")
