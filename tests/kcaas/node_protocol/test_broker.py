"""kcaas.node_protocol.broker with real kombu connections on a temporary folder: stray files (empty, truncated JSON,
JSON that is no message) never stop consumption, every valid message is delivered exactly once, and an old undecodable
file ends in the quarantine folder while a young one is left for a later poll."""

import json
import logging
import os
import threading
import time
from queue import Empty

import kombu
import pytest

from kcaas.node_protocol import broker as fs_broker

QUEUE = kombu.Queue("jobs", kombu.Exchange("jobs"), routing_key="jobs")
FIRST = "0" * 20  # sorts before every message's stamp: the reader meets these files first
STRAYS = {
    f"{FIRST}_a-empty.jobs.msg": b"",
    f"{FIRST}_b-truncated.jobs.msg": b'{"body": "eyJ',
    f"{FIRST}_c-list.jobs.msg": b"[1, 2]",
}


def connection(tmp_path, **extra) -> kombu.Connection:
    return kombu.Connection(fs_broker.URL, transport_options={**fs_broker.folder_options(tmp_path), **extra})


def publish(tmp_path, bodies: list[dict]) -> None:
    with connection(tmp_path) as conn:
        producer = kombu.Producer(conn.default_channel)
        for body in bodies:
            producer.publish(body, exchange=QUEUE.exchange, routing_key="jobs", declare=[QUEUE], serializer="json")


def drop_strays(tmp_path) -> None:
    queue_folder = tmp_path / "queue"
    for name, content in STRAYS.items():
        (queue_folder / name).write_bytes(content)


def consume(tmp_path, count: int, *, into: list | None = None, **extra) -> list[dict]:
    """Drains `jobs` until `into` (shared by concurrent consumers; default a new list) holds `count` messages or 20 s
    passed; returns `into`, bodies in delivery order."""
    received = [] if into is None else into
    with connection(tmp_path, **extra) as conn:
        consumer = kombu.Consumer(
            conn, [QUEUE], accept=["json"], callbacks=[lambda body, message: (received.append(body), message.ack())]
        )
        with consumer:
            deadline = time.monotonic() + 20
            while len(received) < count and time.monotonic() < deadline:
                try:
                    conn.drain_events(timeout=0.2)
                except TimeoutError:
                    pass
    return received


def test_stray_files_do_not_stop_consumption_and_young_ones_stay_for_a_later_poll(tmp_path):
    (tmp_path / "queue").mkdir()
    drop_strays(tmp_path)
    bodies = [{"n": n} for n in range(5)]
    publish(tmp_path, bodies)

    assert consume(tmp_path, len(bodies)) == bodies
    assert sorted(p.name for p in (tmp_path / "queue").glob("*.msg")) == sorted(STRAYS)  # young: left in place
    assert not (tmp_path / "quarantine").exists()


def test_an_old_undecodable_file_is_quarantined_and_logged(tmp_path, caplog):
    (tmp_path / "queue").mkdir()
    drop_strays(tmp_path)
    an_hour_ago = time.time() - 3600
    for name in STRAYS:
        os.utime(tmp_path / "queue" / name, (an_hour_ago, an_hour_ago))
    publish(tmp_path, [{"n": 1}])

    with caplog.at_level(logging.WARNING, logger="kcaas.node_protocol.broker"):
        assert consume(tmp_path, 1) == [{"n": 1}]
    assert sorted(p.name for p in (tmp_path / "quarantine").iterdir()) == sorted(STRAYS)
    assert {(tmp_path / "quarantine" / n).read_bytes() for n in STRAYS} == set(STRAYS.values())  # moved, not rewritten
    assert list((tmp_path / "queue").glob("*.msg")) == []
    assert sum("is not a message" in r.getMessage() for r in caplog.records) == len(STRAYS)


def test_a_file_written_in_place_is_delivered_once_complete(tmp_path):
    """A publisher that creates the file and then fills it (kombu's own transport): a poll that finds it empty
    leaves it in the queue, the next poll after it was filled delivers it."""
    publish(tmp_path, [{"n": "in place"}])
    (published,) = (tmp_path / "queue").glob("*.jobs.msg")
    content = published.read_bytes()
    published.write_bytes(b"")
    with connection(tmp_path) as conn:
        channel = conn.default_channel
        with pytest.raises(Empty):
            channel._get("jobs")
        assert published.exists() and published.read_bytes() == b""
        published.write_bytes(content)
        assert channel._get("jobs") == fs_broker.decoded(content)
    assert not published.exists()


def test_concurrent_consumers_each_message_once(tmp_path):
    bodies = [{"n": n} for n in range(60)]
    publish(tmp_path, bodies)
    delivered: list[dict] = []  # shared: each consumer stops once all were delivered
    threads = [
        threading.Thread(
            target=consume, args=(tmp_path, len(bodies)), kwargs={"into": delivered, "polling_interval": 0.01}
        )
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(body["n"] for body in delivered) == list(range(60))  # every message exactly once


def test_published_files_appear_complete_and_temporaries_are_never_matched(tmp_path):
    publish(tmp_path, [{"n": n, "pad": "x" * 100_000} for n in range(3)])
    names = os.listdir(tmp_path / "queue")
    assert not [n for n in names if n.endswith(".tmp")]
    assert all(fs_broker.decoded((tmp_path / "queue" / n).read_bytes()) for n in names if n.endswith(".msg"))
    assert os.listdir(tmp_path / "control") == ["jobs.exchange"]  # the binding table, made complete, no leftovers
    assert [row[2] for row in json.loads((tmp_path / "control" / "jobs.exchange").read_text())] == ["jobs"]


@pytest.mark.parametrize("url", ["filesystem://", "kcaasfs://"])
def test_both_file_urls_resolve_to_the_hardened_transport(url):
    assert fs_broker.is_file_broker(url)
    assert kombu.Connection(fs_broker.broker_url(url)).transport_cls == fs_broker.SCHEME
    assert isinstance(kombu.Connection(fs_broker.broker_url(url)).transport, fs_broker.Transport)
    assert fs_broker.broker_url("redis://127.0.0.1:6379/1") == "redis://127.0.0.1:6379/1"


def test_a_file_broker_connection_logs_no_hostname_warning(tmp_path, caplog):
    """A folder has no host: kombu's "No hostname was supplied. Reverting to default 'localhost'" was logged by every
    connection of every process on the embedded broker."""
    with caplog.at_level(logging.DEBUG), connection(tmp_path) as conn:
        queue = conn.SimpleQueue("jobs")
        queue.put({"n": 1})
        assert queue.get(timeout=5).payload == {"n": 1}
        queue.close()
        assert conn.info()["hostname"] is None
    assert not [r for r in caplog.records if "hostname" in r.getMessage()], [r.getMessage() for r in caplog.records]
