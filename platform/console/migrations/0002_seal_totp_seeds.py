"""Every django-otp TOTPDevice (seed in clear hex) becomes a ConsoleTOTPDevice with its seed sealed under the KEK
(console/totp_keys.py), keeping its user, name, confirmation, drift, replay guard, throttling and timestamps, and the
clear row is deleted: enrolled authenticators keep working and no seed stays in clear. A session verified with an
old device must sign in again (its device id names the old table). Reversible: unsealed back into otp_totp."""

from binascii import hexlify, unhexlify

from django.db import migrations

from console.totp_keys import totp_key_seal, totp_key_unseal

COPIED = ("user_id", "name", "confirmed", "throttling_failure_timestamp", "throttling_failure_count", "created_at",
          "last_used_at", "step", "t0", "digits", "tolerance", "drift", "last_t")


def seal_seeds(apps, schema_editor):
    clear, sealed = apps.get_model("otp_totp", "TOTPDevice"), apps.get_model("console", "ConsoleTOTPDevice")
    for device in clear.objects.all().order_by("pk"):
        fields = {name: getattr(device, name) for name in COPIED}
        made = sealed.objects.create(key_sealed=totp_key_seal(user_id=device.user_id, seed=unhexlify(device.key)),
                                     **fields)
        sealed.objects.filter(pk=made.pk).update(created_at=device.created_at)  # auto_now_add set it to now
        device.delete()


def unseal_seeds(apps, schema_editor):
    clear, sealed = apps.get_model("otp_totp", "TOTPDevice"), apps.get_model("console", "ConsoleTOTPDevice")
    for device in sealed.objects.all().order_by("pk"):
        seed = totp_key_unseal(user_id=device.user_id, sealed=bytes(device.key_sealed))
        clear.objects.create(key=hexlify(seed).decode(), **{name: getattr(device, name) for name in COPIED})
        device.delete()


class Migration(migrations.Migration):
    dependencies = [
        ("console", "0001_totp_device"),
        ("otp_totp", "0003_add_timestamps"),
    ]

    operations = [migrations.RunPython(seal_seeds, unseal_seeds)]
