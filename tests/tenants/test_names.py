"""Display names of tenants and API keys: NFKC-normalised; no control, format (bidi, zero-width) or other invisible
characters (a 400 naming the field); no tenant name confusable with an existing one (TR39 skeleton, 409); and the
published pattern says exactly which characters are refused."""

from __future__ import annotations

import re
import sys
import unicodedata

import pytest

from tenants import services
from tenants.models import ApiKey, Tenant

from .conftest import assert_error, key_client

TENANTS_URL = "/api/v1/admin/tenants"
KEYS_URL = "/api/v1/keys"

INVISIBLE = {
    "right-to-left override": "\u202e",
    "left-to-right isolate": "\u2066",
    "pop directional isolate": "\u2069",
    "zero-width space": "\u200b",
    "zero-width joiner": "\u200d",
    "zero-width non-joiner": "\u200c",
    "left-to-right mark": "\u200e",
    "byte-order mark": "\ufeff",
    "word joiner": "\u2060",
    "soft hyphen": "\u00ad",
    "arabic letter mark": "\u061c",
    "mongolian vowel separator": "\u180e",
    "variation selector 16": "\ufe0f",
    "combining grapheme joiner": "\u034f",
    "hangul filler": "\u3164",
    "line separator": "\u2028",
    "paragraph separator": "\u2029",
    "delete": "\x7f",
    "c1 control (NEL)": "\x85",
    "escape": "\x1b",
}


@pytest.mark.parametrize("character", INVISIBLE.values(), ids=INVISIBLE.keys())
def test_a_tenant_name_with_an_invisible_or_bidi_character_is_a_400_naming_the_field(staff_client, db, character):
    for name in (f"d{character}emo", f"demo{character}"):
        error = assert_error(staff_client.post(TENANTS_URL, {"name": name}, format="json"), 400, "validation_error")
        assert list(error["details"]["fields"]) == ["name"]
    with pytest.raises(services.ValidationFailed) as refused:  # the service refuses it too (console, commands)
        services.tenant_create(name=f"d{character}emo")
    (message,) = refused.value.details["fields"]["name"]
    assert f"U+{ord(unicodedata.normalize('NFKC', character)):04X}" in message  # U+3164 is NFKC U+1160, refused too
    assert not Tenant.objects.filter(name__startswith="d").exists()


@pytest.mark.parametrize("character", INVISIBLE.values(), ids=INVISIBLE.keys())
def test_an_api_key_name_with_an_invisible_or_bidi_character_is_a_400_naming_the_field(tenant_client, character):
    body = {"name": f"ci{character}-deploy", "scopes": ["caches:read"]}
    error = assert_error(tenant_client.post(KEYS_URL, body, format="json"), 400, "validation_error")
    assert list(error["details"]["fields"]) == ["name"]
    assert not ApiKey.objects.filter(name__startswith="ci").exists()


def test_a_trailing_newline_is_refused_not_trimmed(staff_client, tenant_client):
    """Python's "$" matches before a final newline, JSON Schema's does not: the service holds the schema's reading."""
    error = assert_error(staff_client.post(TENANTS_URL, {"name": "demo\n"}, format="json"), 400, "validation_error")
    assert "U+000A" in error["details"]["fields"]["name"][0]
    body = {"name": "ci\n", "scopes": ["caches:read"]}
    assert_error(tenant_client.post(KEYS_URL, body, format="json"), 400, "validation_error")


def test_the_key_service_refuses_them_too(tenant):
    with pytest.raises(services.ValidationFailed) as refused:
        services.api_key_issue(tenant=tenant, scopes=["caches:read"], name="ci\u202e-deploy")
    assert "U+202E RIGHT-TO-LEFT OVERRIDE" in refused.value.details["fields"]["name"][0]


def test_names_are_stored_nfkc_normalised(staff_client, tenant_client):
    answer = staff_client.post(
        TENANTS_URL, {"name": "\uff21\uff43\uff4d\uff45 \ufb01nance"}, format="json"
    )  # "Ａｃｍｅ ﬁnance"
    assert answer.status_code == 201, answer.content
    assert answer.json()["name"] == "Acme finance" and Tenant.objects.filter(name="Acme finance").exists()
    key = tenant_client.post(KEYS_URL, {"name": "\u2460 build\u2122", "scopes": ["caches:read"]}, format="json")
    assert key.status_code == 201 and key.json()["name"] == "1 buildTM"  # "① build™"


def test_a_name_differing_only_in_compatibility_form_is_the_same_name(staff_client, db):
    assert staff_client.post(TENANTS_URL, {"name": "acme"}, format="json").status_code == 201
    assert_error(
        staff_client.post(TENANTS_URL, {"name": "\uff41\uff43\uff4d\uff45"}, format="json"), 409, "tenant_name_taken"
    )  # fullwidth "ａｃｍｅ"


def test_invisible_characters_beyond_the_bmp_are_removed(staff_client, db):
    """Tag characters (U+E0000..) and the variation selectors supplement cannot be named by a pattern every JSON
    Schema tool reads, so the schema allows them and normalisation removes them: they cannot hide in a name."""
    answer = staff_client.post(TENANTS_URL, {"name": "demo\U000e0041\U000e0042\U000e0100"}, format="json")
    assert answer.status_code == 201 and answer.json()["name"] == "demo"
    assert_error(staff_client.post(TENANTS_URL, {"name": "de\U000e0001mo"}, format="json"), 409, "tenant_name_taken")
    assert_error(staff_client.post(TENANTS_URL, {"name": "\U000e0020"}, format="json"), 400, "validation_error")


@pytest.mark.parametrize(
    "lookalike",
    [
        "d\u0435mo",  # Cyrillic е
        "\u0501emo",  # Cyrillic ԁ
        "dem\u03bf",  # Greek ο
        "d\u0435m\u043e",  # Cyrillic е and о
        "derno",  # "rn" for "m"
        "\uff44emo",  # fullwidth ｄ (NFKC: the same name, so tenant_name_taken)
    ],
)
def test_a_tenant_name_confusable_with_an_existing_one_is_refused(staff_client, db, lookalike):
    existing = staff_client.post(TENANTS_URL, {"name": "demo"}, format="json").json()
    answer = staff_client.post(TENANTS_URL, {"name": lookalike}, format="json")
    assert answer.status_code == 409, answer.content
    error = answer.json()["error"]
    if unicodedata.normalize("NFKC", lookalike) == "demo":
        assert error["code"] == "tenant_name_taken"
    else:
        assert error["code"] == "tenant_name_confusable"
        assert error["details"]["fields"] == {"name": ["Confusable with an existing tenant name."]}
        assert error["details"]["confusable_with"] == {"id": existing["id"], "name": "demo"}
    assert Tenant.objects.count() == 1


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ("paypal", "\u0440\u0430ypal"),
        ("Apple", "\u0410pple"),
        ("bank-1", "bank-l"),
        ("bank-l", "bank-I"),
        ("OMEGA", "\u039fMEGA"),
        ("corp0", "corpO"),
        ("sh\u0435ll", "shell"),
    ],
)
def test_confusables_either_way_round(make_tenant, first, second):
    make_tenant(first)
    with pytest.raises(services.ConflictError) as refused:
        services.tenant_create(name=second)
    assert refused.value.code == "tenant_name_confusable"


def test_names_that_only_look_different_are_fine(make_tenant):
    for name in ("demo", "Demo", "demos", "dëmo", "démo", "memo", "d e m o", "данные", "δεδομένα"):
        make_tenant(name)
    assert Tenant.objects.count() == 9


def test_skeleton_is_tr39s_over_latin_cyrillic_and_greek():
    from tenants import names

    assert names.skeleton("d\u0435mo") == names.skeleton("demo") == "derno"
    assert names.skeleton("m") == "rn" and names.skeleton("1") == names.skeleton("I") == "l"
    assert names.skeleton("\u0451") == names.skeleton("\u00eb")  # Cyrillic ё and Latin ë: base and mark
    assert names.skeleton("Demo") != names.skeleton("demo")  # case is not confusion (TR39)


# ---- the published pattern says what the service refuses ------------------------------------------------------------


def test_the_pattern_refuses_exactly_the_characters_the_service_refuses_in_the_bmp():
    from tenants import names

    pattern = re.compile(names.NAME_PATTERN)
    for code_point in range(0x10000):
        character = chr(code_point)
        if unicodedata.category(character) == "Cs":
            continue  # lone surrogates: DRF refuses them before the pattern (and no schema tool can state them)
        allowed = pattern.fullmatch(character) is not None  # JSON Schema's reading: "$" is the end, newline or not
        assert allowed is not names.is_refused(character), f"U+{code_point:04X}"


def test_beyond_the_bmp_the_pattern_allows_what_normalisation_removes():
    from tenants import names

    pattern = re.compile(names.NAME_PATTERN)
    for code_point in range(0x10000, sys.maxunicode + 1):
        character = chr(code_point)
        assert pattern.fullmatch(character) is not None, f"U+{code_point:05X}"
        if names.is_refused(character):
            assert names.normalized(f"a{character}b") == "ab"


def test_the_format_characters_table_is_unicodes():
    """FORMAT_CHARACTERS is written out (computing it costs every process 70 ms); a newer Unicode database with more
    format characters must update it, or the pattern would allow what the service refuses."""
    from tenants import names

    table = {cp for low, high in names.FORMAT_CHARACTERS for cp in range(low, high + 1)}
    assert table == {cp for cp in range(sys.maxunicode + 1) if unicodedata.category(chr(cp)) == "Cf"}


def test_the_schema_publishes_the_pattern(staff_client):
    from tenants import names

    schema = staff_client.get("/api/schema/?format=json").json()["components"]["schemas"]
    assert schema["TenantCreateRequest"]["properties"]["name"]["pattern"] == names.NONBLANK_NAME_PATTERN
    key_name = schema["KeyCreateRequest"]["properties"]["name"]
    assert names.NAME_PATTERN in [variant.get("pattern") for variant in key_name.get("oneOf", [key_name])]
    assert "\\u202e" in names.NAME_PATTERN and "\\u200b" in names.NAME_PATTERN


def test_an_existing_key_name_is_kept_through_rotation(tenant, make_key):
    issued = make_key(tenant, name="ci deploy")
    successor = services.api_key_rotate(api_key=issued.api_key, overlap_seconds=0)
    assert successor.api_key.name == "ci deploy"
    assert key_client(successor.raw_key).get("/api/v1/whoami").status_code == 200
