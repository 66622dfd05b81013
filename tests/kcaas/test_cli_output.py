"""The `kcaas` command line's formatting helpers on exact inputs: short ids, tables cut to 100 columns, details
flattened to one `field: problem` line each. (Their use on the live server: test_cli_names.py.)"""

from kcaas.cli_errors import detail_lines, enveloped
from kcaas.cli_output import short_ids, table
from kcaas.errors import NotFoundError, ServerError


def test_short_ids_are_eight_characters_unless_a_neighbour_shares_more():
    ids = ["0123456789-a", "0123456789-b", "abcdef00-1", "ffff0000-9"]
    assert short_ids(ids) == {
        "0123456789-a": "0123456789-a",
        "0123456789-b": "0123456789-b",
        "abcdef00-1": "abcdef00",
        "ffff0000-9": "ffff0000",
    }
    assert short_ids(["0123456789aa", "0123456789bb", "01234567zzzz"])["01234567zzzz"] == "01234567z"


def test_a_table_cuts_its_elidable_columns_widest_first_to_fit():
    rows = [("id1", "n" * 90, "ready", "e" * 60)]
    text = table(("ID", "NAME", "STATE", "ENDPOINT"), rows, elidable=("NAME", "ENDPOINT"))
    assert text.splitlines()[1] == "id1  " + "n" * 40 + "...  ready  " + "e" * 40 + "..."  # 100 columns
    cut_one = table(("ID", "NAME", "ENDPOINT"), [("id1", "n" * 90, "e" * 40)], elidable=("NAME", "ENDPOINT"))
    assert cut_one.splitlines()[1] == "id1  " + "n" * 50 + "...  " + "e" * 40  # the widest only, while it is
    assert table(("ID", "NAME"), [("id1", "n" * 120)], width=None).splitlines()[1] == "id1  " + "n" * 120


def test_details_become_one_line_per_problem_with_dotted_fields():
    details = {
        "fields": {"spec": {"num_layers": ["Too big.", "Not even."]}, "items": [{"name": ["Blank."]}]},
        "limit": "max_caches",
    }
    assert detail_lines(details) == [
        "spec.num_layers: Too big.",
        "spec.num_layers: Not even.",
        "items[0].name: Blank.",
        "limit: max_caches",
    ]


def test_an_answer_without_the_api_envelope_is_told_from_the_apis_own():
    assert enveloped(NotFoundError("No such cache.", status=404))
    assert not enveloped(NotFoundError("Not Found", status=404))  # the reason phrase: a body without the envelope
    assert not enveloped(ServerError("<html><body>502</body></html>", status=502))
    assert enveloped(ServerError("An internal error occurred.", status=500, code="internal_error"))


def test_show_says_a_cold_cache_was_emptied_and_when():
    from kcaas.cli import _show_cache
    from kcaas.resources import Cache

    body = {"id": "c1", "name": "chat", "state": "ready", "contents": "cold", "emptied_at": "2026-12-02T10:00:00Z"}
    cold = Cache.from_json(body)
    assert cold.contents == "cold" and cold.emptied_at is not None and cold.emptied_at.year == 2026
    shown = _show_cache(cold)
    assert "contents:    cold: its node came back without it at" in shown and "2026-12-02" in shown
    warm = Cache.from_json({**body, "contents": "warm", "emptied_at": None})
    assert warm.emptied_at is None and "contents:    warm: its node reports blocks of it" in _show_cache(warm)
    fresh = Cache.from_json({**body, "emptied_at": None})  # new: cold, and never said to have been emptied
    assert "contents:    cold: its node reports no block of it" in _show_cache(fresh)
    assert "came back" not in _show_cache(fresh)
    for state in ("provisioning", "detached"):  # no node serves it: no contents
        assert "contents:    -" in _show_cache(Cache.from_json({**body, "state": state, "contents": None}))
    assert Cache.from_json({"id": "c1", "name": "chat", "state": "ready"}).contents == ""  # an older server
