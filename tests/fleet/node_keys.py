"""The sealing key test nodes register (kcaas/node_protocol/sealing.py): stand-in node consumers and in-process node
apps open the keys of their orders with it. One fixed key for every test node: the associated data (task, node id, cache
id, field) still binds each box to its own message; tests about one node's box on another node make keys of their
own."""

from kcaas.node_protocol.sealing import NodeSealingKey

TEST_SEALING_KEY = NodeSealingKey.from_private_bytes(bytes(range(1, 33)))
TEST_SEALING_PUBLIC_KEY = TEST_SEALING_KEY.public_key_b64


def opened(box: str, *, task: str, node_id, cache_id, field: str = "hash_key", key: NodeSealingKey = TEST_SEALING_KEY):
    """The key in `box` as a test node opens it."""
    return key.open(box, task=task, node_id=node_id, cache_id=cache_id, field=field)
