"""The console's TOTP seeds are sealed at rest (console/totp_keys.py, console.models.ConsoleTOTPDevice): after a real
enrolment no row of any OTP table holds the seed in any encoding, the sealed seed is bound to its user and KEK, and
migration console.0002 seals the devices enrolled before (clear django-otp rows), which still sign in afterwards."""

from __future__ import annotations

import base64
from binascii import hexlify

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.test import Client
from django_otp.plugins.otp_totp.models import TOTPDevice as ClearTOTPDevice

from console import roles
from console.models import ConsoleTOTPDevice
from console.totp_keys import TotpKeyError, totp_key_seal, totp_key_unseal
from tests.console.conftest import PASSWORD, make_console_user, totp_code


def _otp_rows() -> list[bytes]:
    """Every row of every table django-otp or the console keeps devices in, as bytes (text and binary columns)."""
    rows = []
    with connection.cursor() as cursor:
        for table in connection.introspection.table_names():
            if "otp" in table:
                cursor.execute(f'SELECT * FROM "{table}"')  # noqa: S608 - names from the introspection
                for row in cursor.fetchall():
                    rows.append(
                        b"|".join(bytes(v) if isinstance(v, (bytes, memoryview)) else str(v).encode() for v in row)
                    )
    return rows


def _forms(seed: bytes) -> list[bytes]:
    return [
        seed,
        hexlify(seed),
        hexlify(seed).upper(),
        base64.b32encode(seed),
        base64.b32encode(seed).rstrip(b"="),
        base64.b64encode(seed),
    ]


def _enrol(user) -> bytes:
    """A real first sign-in: password, the enrolment page, the code from the shown secret. Returns the seed as the
    user's authenticator holds it."""
    client = Client()
    answer = client.post("/console/login", {"username": user.username, "password": PASSWORD})
    assert "/console/login/enroll" in answer["Location"]
    shown = client.get("/console/login/enroll").context["secret_b32"].replace(" ", "")
    seed = base64.b32decode(shown + "=" * (-len(shown) % 8))
    device = ConsoleTOTPDevice.objects.get(user=user)
    assert client.post("/console/login/enroll", {"code": totp_code(device)}).status_code == 302
    assert client.get("/console/").status_code == 200
    return seed


@pytest.mark.django_db
def test_no_otp_table_holds_an_enrolled_seed():
    user, _ = make_console_user(roles.OPERATOR, enrolled=False)
    seed = _enrol(user)
    rows = _otp_rows()
    assert rows, "the enrolled device is somewhere"
    for row in rows:
        for form in _forms(seed):
            assert form not in row, f"a TOTP seed is stored in clear ({form[:8]!r}...)"
    assert ClearTOTPDevice.objects.count() == 0


@pytest.mark.django_db
def test_a_sealed_seed_opens_only_for_its_user_and_kek(settings):
    user, device = make_console_user(roles.OPERATOR)
    other, _ = make_console_user(roles.OPERATOR)
    sealed = bytes(device.key_sealed)
    assert totp_key_unseal(user_id=user.pk, sealed=sealed) == device.bin_key and len(device.bin_key) == 20
    with pytest.raises(TotpKeyError):
        totp_key_unseal(user_id=other.pk, sealed=sealed)  # copied onto another user's device
    ConsoleTOTPDevice.objects.filter(pk=device.pk).update(user=other)
    moved = ConsoleTOTPDevice.objects.get(pk=device.pk)
    assert moved.verify_token(totp_code(device)) is False  # verifies nothing, raises nothing
    settings.KCAAS_KEK = "another kek"
    with pytest.raises(TotpKeyError):
        totp_key_unseal(user_id=user.pk, sealed=sealed)


@pytest.mark.django_db(transaction=True)
def test_the_migration_seals_devices_enrolled_in_clear_and_they_still_sign_in():
    executor = MigrationExecutor(connection)
    executor.migrate([("console", "0001_totp_device")])  # before the seeds were sealed
    try:
        user, _ = make_console_user(roles.OPERATOR, enrolled=False)
        seed = bytes(range(20))
        clear = ClearTOTPDevice.objects.create(
            user=user, name="console", confirmed=True, key=hexlify(seed).decode(), drift=1, last_t=5
        )
        assert any(hexlify(seed) in row for row in _otp_rows())  # the clear row, as older versions stored it
    finally:
        executor = MigrationExecutor(connection)
        executor.loader.build_graph()
        executor.migrate(executor.loader.graph.leaf_nodes())
    assert not ClearTOTPDevice.objects.filter(pk=clear.pk).exists()
    device = ConsoleTOTPDevice.objects.get(user=user)
    assert (device.name, device.confirmed, device.drift, device.last_t) == ("console", True, 1, 5)
    assert device.bin_key == seed and all(form not in row for row in _otp_rows() for form in _forms(seed))

    client = Client()  # the authenticator enrolled before the upgrade still signs in
    answer = client.post("/console/login", {"username": user.username, "password": PASSWORD})
    assert "/console/login/verify" in answer["Location"]
    assert client.post("/console/login/verify", {"code": totp_code(device)}).status_code == 302
    assert client.get("/console/").status_code == 200


@pytest.mark.django_db
def test_a_seed_sealed_for_the_migration_is_the_models_format():
    user, _ = make_console_user(roles.OPERATOR, enrolled=False)
    device = ConsoleTOTPDevice.objects.create(
        user=user, name="x", key_sealed=totp_key_seal(user_id=user.pk, seed=b"s" * 20)
    )
    assert ConsoleTOTPDevice.objects.get(pk=device.pk).bin_key == b"s" * 20
