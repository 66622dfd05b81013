"""Keys sealed to one node (kcaas/node_protocol/sealing.py) and the node's side of them (gpu_node/agent/tasks.py
NodeKeys, the sealing key kept with the identity, the agent's registration): a box opens only on the node it was sealed
to and only for the message it was sealed for; an altered one never yields a key."""

from __future__ import annotations

import base64
import os
import stat
import uuid

import pytest

from gpu_node.agent.identity import SEALING_KEY_FILE, load_sealing_key
from gpu_node.agent.tasks import NodeKeys, unsealed_keys
from kcaas.node_protocol.messages import MIGRATE_IN_TASK, PROVISION_TASK
from kcaas.node_protocol.sealing import (
    KEY_NOT_SEALED,
    NO_SEALING_KEY,
    SEALED_FOR_OTHER_KEY,
    SEALED_KEY_INVALID,
    NodeSealingKey,
    SealedKeyError,
    public_key_bytes,
    seal,
)

KEY = os.urandom(32)
NODE, CACHE = str(uuid.uuid4()), str(uuid.uuid4())
WHERE = {"task": PROVISION_TASK, "node_id": NODE, "cache_id": CACHE, "field": "hash_key"}


def box_for(key: NodeSealingKey, plaintext: bytes = KEY, **where) -> str:
    return seal(plaintext, public_key_b64=key.public_key_b64, **{**WHERE, **where})


def refusal(key: NodeSealingKey, box: str, **where) -> str:
    with pytest.raises(SealedKeyError) as refused:
        key.open(box, **{**WHERE, **where})
    return refused.value.reason


def test_a_box_opens_on_its_node_for_its_message():
    node = NodeSealingKey()
    box = box_for(node)
    assert node.open(box, **WHERE) == KEY
    assert node.open(box, **{**WHERE, "node_id": uuid.UUID(NODE)}) == KEY  # ids compare canonically
    assert box_for(node) != box  # a fresh ephemeral key per box: no two boxes alike


def test_a_box_sealed_for_one_node_does_not_open_on_another():
    one, other = NodeSealingKey(), NodeSealingKey()
    assert refusal(other, box_for(one)) == SEALED_FOR_OTHER_KEY
    # even claiming the other node's key id: without the private key the AES key cannot be derived
    forged = box_for(one)
    raw = base64.urlsafe_b64decode(forged[5:] + "=" * (-len(forged[5:]) % 4))
    claimed = bytes.fromhex(other.key_id) + raw[8:]
    assert refusal(other, "kcs1." + base64.urlsafe_b64encode(claimed).decode().rstrip("=")) == SEALED_KEY_INVALID


@pytest.mark.parametrize(
    "where",
    [
        {"task": MIGRATE_IN_TASK},
        {"node_id": str(uuid.uuid4())},
        {"cache_id": str(uuid.uuid4())},
        {"field": "ssd_key"},
    ],
)
def test_a_box_replayed_into_another_message_does_not_open(where):
    node = NodeSealingKey()
    assert refusal(node, box_for(node), **where) == SEALED_KEY_INVALID


def test_every_altered_byte_is_refused():
    node = NodeSealingKey()
    box = box_for(node)
    raw = base64.urlsafe_b64decode(box[5:] + "=" * (-len(box[5:]) % 4))
    for index in range(len(raw)):
        altered = bytearray(raw)
        altered[index] ^= 0x80
        reason = refusal(node, "kcs1." + base64.urlsafe_b64encode(bytes(altered)).decode().rstrip("="))
        assert reason == (SEALED_FOR_OTHER_KEY if index < 8 else SEALED_KEY_INVALID), index
    assert refusal(node, box[:40]) == SEALED_KEY_INVALID  # truncated
    assert refusal(node, box + "!") == SEALED_KEY_INVALID  # not base64


def test_a_key_in_clear_is_refused():
    node = NodeSealingKey()
    assert refusal(node, base64.b64encode(KEY).decode()) == KEY_NOT_SEALED
    assert refusal(node, "") == KEY_NOT_SEALED


def test_only_usable_public_keys_are_accepted():
    assert public_key_bytes(NodeSealingKey().public_key_b64)
    for bad in (
        "not base64",
        base64.b64encode(b"x" * 31).decode(),
        base64.b64encode(bytes(32)).decode(),
        base64.b64encode((1).to_bytes(32, "little")).decode(),
    ):  # low-order points
        with pytest.raises(ValueError):
            public_key_bytes(bad)


def test_node_keys_open_both_keys_and_say_why_they_refuse():
    node = NodeSealingKey()
    keys = NodeKeys(node, NODE)
    ssd = os.urandom(32)
    hash_box, ssd_box = box_for(node), box_for(node, ssd, field="ssd_key")
    assert keys.open(task=PROVISION_TASK, cache_id=CACHE, hash_key_box=hash_box, ssd_key_box=ssd_box) == (KEY, ssd)
    assert keys.open(task=PROVISION_TASK, cache_id=CACHE, hash_key_box=hash_box) == (KEY, None)
    where = {"task": PROVISION_TASK, "cache_id": CACHE}
    assert unsealed_keys(keys, **where, hash_key_box=hash_box, ssd_key_box=ssd_box) == (KEY, ssd, "")
    # the two boxes swapped: each is bound to its field
    assert unsealed_keys(keys, **where, hash_key_box=ssd_box, ssd_key_box=hash_box) == (None, None, SEALED_KEY_INVALID)
    assert unsealed_keys(None, **where, hash_key_box=hash_box, ssd_key_box="") == (None, None, NO_SEALING_KEY)
    other = box_for(NodeSealingKey())
    assert unsealed_keys(keys, **where, hash_key_box=other, ssd_key_box="") == (None, None, None)  # not answered
    clear = base64.b64encode(KEY).decode()
    assert unsealed_keys(keys, **where, hash_key_box=clear, ssd_key_box="") == (None, None, KEY_NOT_SEALED)


def test_the_sealing_key_is_kept_0600_in_the_identity_directory(tmp_path):
    directory = tmp_path / "identity"
    made = load_sealing_key(directory)
    path = directory / SEALING_KEY_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(directory.stat().st_mode) == 0o700
    again = load_sealing_key(directory)  # a restart: the same key, so orders sealed meanwhile still open
    assert again.public_key_b64 == made.public_key_b64
    assert again.open(box_for(made), **WHERE) == KEY


def test_the_agent_registers_its_sealing_key(tmp_path):
    from gpu_node.agent.process import AgentConfig, NodeAgent
    from gpu_node.agent.registry import CacheRegistry

    class Control:
        def __init__(self):
            self.bodies = []

        def register(self, **body):
            self.bodies.append(body)
            return {"node": {"id": NODE}}

    config = AgentConfig(
        control_url="http://unused",
        credential="x",
        broker_url="memory://",
        endpoint="127.0.0.1:1",
        device_capacity_bytes=1 << 20,
        identity=False,
        identity_dir=str(tmp_path / "identity"),
    )
    agent = NodeAgent(config, control=(control := Control()))
    agent.registry = CacheRegistry(device_capacity_bytes=1 << 20, device="cpu")
    agent._load_identity()
    agent.register()
    assert control.bodies[0]["sealing_public_key"] == agent.sealing_key.public_key_b64
    assert load_sealing_key(tmp_path / "identity").public_key_b64 == agent.sealing_key.public_key_b64
