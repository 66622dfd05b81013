"""The routing index from vLLM's events to a lookup's answer, through the REST API (real PostgreSQL, real keys):
what an instance stored is found from the prompt's start, whole blocks; what it removed, cleared or lost is not;
blocks whose parent it never announced are never advertised; a LoRA or salted block matches only its own requests;
and one tenant learns nothing of another's instances (lookups, lists, ids, registration names)."""

import uuid

import pytest

from audit.actions import AuditAction
from audit.models import AuditEvent
from kcaas.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from routing import services
from routing.models import EngineInstance, IndexedBlock
from tests.routing.conftest import engine_body

pytestmark = pytest.mark.django_db

PROMPT = list(range(100, 118))  # 18 tokens: 4 whole blocks of 4 (and 2 tokens over)


def stored(hashes, tokens, parent=None, *, medium="GPU", extra_keys=None) -> BlockStored:
    return BlockStored(tuple(hashes), parent, tuple(tokens), 4, medium, extra_keys=extra_keys)


def apply(instance_id, *events, seq=None) -> None:
    instance = EngineInstance.objects.get(id=instance_id)
    seq = instance.next_seq if seq is None else seq
    assert services.apply_batch(instance_id=instance.id, seq=seq, batch=EventBatch(0.0, tuple(events)))


def lookup(handle, tokens, model="tiny-llama", **extra) -> dict:
    answer = handle.client.post("/api/v1/engines/lookup", {"model": model, "token_ids": tokens, **extra}, format="json")
    assert answer.status_code == 200, answer.json()
    return {hit["name"]: hit["prefix_tokens"] for hit in answer.json()["instances"]}


def test_a_lookup_finds_the_longest_contiguous_prefix_per_instance_and_medium(tenant_a, register):
    one, two = register(tenant_a, name="one")["id"], register(tenant_a, name="two", port=5567)["id"]
    apply(one, stored([11, 12], PROMPT[:8]))  # blocks 0-1 in two events: chained through the parent
    apply(one, stored([13], PROMPT[8:12], parent=12))
    apply(one, stored([21], PROMPT[:4], medium="CPU"))
    apply(two, stored([31], PROMPT[:4]), stored([33], PROMPT[8:12], parent=32))  # block 2 without block 1
    apply(two, stored([32], PROMPT[4:8], parent=31, medium="CPU"))  # block 1, offloaded: after block 0 on the GPU

    # per medium: the prefix held in it or a faster one (GPU, then CPU)
    assert lookup(tenant_a, PROMPT) == {"one": {"GPU": 12, "CPU": 12}, "two": {"GPU": 4, "CPU": 8}}
    # whole blocks only; a medium is named where it holds one of the prompt's blocks
    assert lookup(tenant_a, PROMPT[:7]) == {"one": {"GPU": 4, "CPU": 4}, "two": {"GPU": 4}}
    assert lookup(tenant_a, [1, 2, 3, 4, *PROMPT]) == {"one": {}, "two": {}}  # a prefix, not a substring
    assert lookup(tenant_a, PROMPT, model="another-model") == {}
    assert not IndexedBlock.objects.filter(instance_id=two, engine_hash="33").exists()  # its parent was never seen


def test_removed_cleared_and_lost_blocks_leave_the_index(tenant_a, register):
    one = register(tenant_a, name="one")["id"]
    apply(one, stored([11, 12, 13], PROMPT[:12]))
    apply(one, BlockRemoved((12,), "GPU"))
    assert lookup(tenant_a, PROMPT) == {"one": {"GPU": 4}}
    apply(one, stored([12], PROMPT[4:8], parent=11))
    assert lookup(tenant_a, PROMPT) == {"one": {"GPU": 12}}
    apply(one, AllBlocksCleared())
    assert lookup(tenant_a, PROMPT) == {"one": {}}

    apply(one, stored([11], PROMPT[:4]))
    assert services.mark_lost(instance_id=one)
    assert lookup(tenant_a, PROMPT) == {}  # a lost instance is not offered at all
    assert not IndexedBlock.objects.filter(instance_id=one).exists()
    assert AuditEvent.objects.filter(action=AuditAction.ENGINE_LOST, target_id=one).count() == 1
    services.mark_healthy(instance_id=one)
    assert lookup(tenant_a, PROMPT) == {"one": {}}


def test_batches_apply_once_and_in_order(tenant_a, register):
    one = register(tenant_a, name="one")["id"]
    batch = EventBatch(0.0, (stored([11], PROMPT[:4]),))
    assert not services.apply_batch(instance_id=one, seq=1, batch=batch)  # seq 0 is expected first
    assert services.apply_batch(instance_id=one, seq=0, batch=batch)
    assert not services.apply_batch(instance_id=one, seq=0, batch=batch)  # applied already
    instance = EngineInstance.objects.get(id=one)
    assert (instance.next_seq, instance.events_applied) == (1, 1)


def test_lora_and_salted_blocks_match_only_their_own_requests(tenant_a, register):
    one = register(tenant_a, name="one")["id"]
    apply(one, stored([11], PROMPT[:4], extra_keys=(("my-lora",),)))
    apply(one, stored([51], PROMPT[:4], extra_keys=(("my-lora", "salt-7"),)))
    assert lookup(tenant_a, PROMPT) == {"one": {}}
    assert lookup(tenant_a, PROMPT, lora_name="my-lora") == {"one": {"GPU": 4}}
    assert lookup(tenant_a, PROMPT, lora_name="other") == {"one": {}}


def test_another_tenant_learns_nothing_of_an_instance(tenant_a, tenant_b, register):
    one = register(tenant_a, name="shared-name")["id"]
    apply(one, stored([11, 12], PROMPT[:8]))
    assert lookup(tenant_a, PROMPT) == {"shared-name": {"GPU": 8}}

    assert lookup(tenant_b, PROMPT) == {}
    assert tenant_b.client.get("/api/v1/engines").json() == []
    assert tenant_b.client.get(f"/api/v1/engines/{one}").status_code == 404
    assert tenant_b.client.delete(f"/api/v1/engines/{one}").status_code == 404
    assert tenant_b.client.get(f"/api/v1/engines/{uuid.uuid4()}").status_code == 404  # the same answer as a stranger
    register(tenant_b, name="shared-name")  # the name is per tenant: nothing says A has one
    assert lookup(tenant_b, PROMPT) == {"shared-name": {}}
    assert EngineInstance.objects.get(id=one).blocks.count() == 2


def test_registration_is_validated_audited_and_undone(tenant_a, register):
    client = tenant_a.client
    one = register(tenant_a, name="one")
    assert one["state"] == "live" and one["next_seq"] == 0
    taken = client.post("/api/v1/engines", {**one_body(), "name": "one"}, format="json")
    assert taken.status_code == 409 and taken.json()["error"]["code"] == "name_taken"
    for bad, code in [
        ({"events_endpoint": "tcp://8.8.8.8:5557"}, "endpoint_not_allowed"),  # the indexer would connect there
        ({"api_base": "http://8.8.8.8:8000"}, "endpoint_not_allowed"),
        ({"events_endpoint": "ipc:///tmp/x"}, "invalid_endpoint"),
        ({"events_endpoint": "tcp://engine.example.com:5557"}, "invalid_endpoint"),  # a name could move
        ({"replay_endpoint": "tcp://127.0.0.1"}, "invalid_endpoint"),
    ]:
        answer = client.post("/api/v1/engines", {**one_body(), **bad}, format="json")
        assert answer.status_code == 400 and answer.json()["error"]["code"] == code, (bad, answer.json())
    answer = client.post("/api/v1/engines", {**one_body(), "tenant": "x"}, format="json")
    assert answer.status_code == 400  # no field outside the schema, the tenant least of all
    assert client.post("/api/v1/engines/lookup", {"model": "m", "token_ids": [-1]}, format="json").status_code == 400
    assert AuditEvent.objects.filter(action=AuditAction.ENGINE_REGISTERED, target_id=one["id"]).count() == 1

    assert client.delete(f"/api/v1/engines/{one['id']}").status_code == 204
    assert client.get(f"/api/v1/engines/{one['id']}").status_code == 404
    assert AuditEvent.objects.filter(action=AuditAction.ENGINE_DEREGISTERED, target_id=one["id"]).count() == 1


def test_an_instance_without_a_replay_socket_registers(tenant_a, register):
    assert register(tenant_a, name="no-replay", replay_endpoint="")["replay_endpoint"] == ""


def test_a_read_only_key_may_look_up_but_not_register(tenant_a, register):
    register(tenant_a, name="one")
    reader = tenant_a.key("caches:read")
    looked = reader.post("/api/v1/engines/lookup", {"model": "tiny-llama", "token_ids": PROMPT}, format="json")
    assert looked.status_code == 200
    answer = reader.post("/api/v1/engines", one_body("two"), format="json")
    assert answer.status_code == 403 and answer.json()["error"]["details"]["required_scope"] == "caches:write"


def one_body(name: str = "other"):
    return engine_body(name, port=5577)
