"""tests/faults.PrivatePostgres, which the outage tests stand on: a server of the test's own that keeps its data
across stop()/start(), refuses connections while stopped, and leaves nothing running or on disk after close()."""

import psycopg
import pytest

from tests.faults import PrivatePostgres, listening

pytestmark = pytest.mark.skipif(PrivatePostgres.available() is not None, reason=str(PrivatePostgres.available()))


def test_data_survives_a_restart_and_close_leaves_nothing():
    with PrivatePostgres() as server:
        url = server.create_database("probe")
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE TABLE t (v int)")
            conn.execute("INSERT INTO t VALUES (42)")
        server.stop()
        assert not listening(server.port)
        with pytest.raises(psycopg.OperationalError):
            psycopg.connect(url, connect_timeout=2)
        server.start()
        with psycopg.connect(url) as conn:
            assert conn.execute("SELECT v FROM t").fetchone() == (42,)
    assert not listening(server.port) and not server.root.exists()
