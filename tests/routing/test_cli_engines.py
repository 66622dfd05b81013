"""`kcaas engines ...` against the live control plane (main() in process, the tenant's key): register, list, look up
(from the index the events built), deregister by name; bad token ids and unknown names are usage errors (exit 2)."""

import json

import pytest

from kcaas.cli import main
from kcaas.kv_events import BlockStored, EventBatch
from routing import services
from tests.routing.test_index import PROMPT

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def cli(live_server, capsys):
    def run(raw_key, *argv):
        code = main(["--url", live_server.url, "--api-key", raw_key, *argv])
        out, err = capsys.readouterr()
        assert raw_key not in out + err
        return code, out, err

    return run


def test_register_list_lookup_and_deregister(make_tenant, cli, tmp_path):
    key = make_tenant().raw_key
    code, out, err = cli(
        key, "engines", "register", "gpu-0", "--model", "tiny-llama", "--block-size", "4", "--api-base",
        "http://127.0.0.1:8001", "--events", "tcp://127.0.0.1:5557",
    )  # fmt: skip
    assert code == 0, err
    instance_id = out.split()[0]
    services.apply_batch(
        instance_id=instance_id, seq=0, batch=EventBatch(0.0, (BlockStored((1, 2), None, tuple(PROMPT[:8]), 4),))
    )

    code, out, _ = cli(key, "engines", "ls")
    assert out.splitlines()[1].split()[:4] == ["gpu-0", "tiny-llama", "live", "4"]
    tokens = tmp_path / "ids.json"
    tokens.write_text(json.dumps(PROMPT))
    code, out, _ = cli(key, "engines", "lookup", "--model", "tiny-llama", "--tokens-file", str(tokens), "--json")
    assert code == 0 and json.loads(out)["instances"][0]["prefix_tokens"] == {"GPU": 8}
    code, out, _ = cli(key, "engines", "lookup", "--model", "tiny-llama", "--tokens", ",".join(map(str, PROMPT[:5])))
    assert code == 0 and out.splitlines()[2].split() == ["instance", "gpu-0", "4", "0", "0", "0", "2"]

    assert cli(key, "engines", "lookup", "--model", "m", "--tokens", "1,x")[0] == 2
    assert cli(key, "engines", "deregister", "no-such-engine")[0] == 2
    code, out, _ = cli(key, "engines", "deregister", "gpu-0")
    assert code == 0 and cli(key, "engines", "ls", "--json")[1].strip() == "[]"
