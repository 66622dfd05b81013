"""core.keys: the key format, its offline checksum, peppered hashing and constant-time comparison."""

import hmac
import re
import zlib

import pytest
from django.test import override_settings
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from core import keys

KEY_RE = re.compile(r"kc_live_[0-9A-Za-z]{16}_[0-9A-Za-z]{43}[0-9A-Za-z]{6}")


def test_generated_key_has_the_documented_shape_and_parses_back():
    raw, public_id, secret = keys.generate_key()
    assert KEY_RE.fullmatch(raw)
    assert len(raw) == len("kc_live_") + 16 + 1 + 43 + 6
    assert keys.parse_key(raw) == ("kc_live", public_id, secret)
    assert raw.startswith(f"kc_live_{public_id}_{secret}")


def test_checksum_is_crc32_of_everything_before_it_in_base62():
    raw, _, _ = keys.generate_key()
    body, crc = raw[:-6], raw[-6:]
    value = 0
    for char in crc:
        value = value * 62 + keys.BASE62.index(char)
    assert value == zlib.crc32(body.encode())


def test_node_prefix_is_supported_and_bad_prefixes_are_refused():
    raw, public_id, secret = keys.generate_key(keys.NODE_KEY_PREFIX)
    assert raw.startswith("kc_node_") and keys.parse_key(raw) == ("kc_node", public_id, secret)
    for prefix in ("live", "kc_Live", "kc_", "kc_li_ve", "xx_live"):
        with pytest.raises(ValueError):
            keys.generate_key(prefix)


def test_keys_are_unique():
    generated = {keys.generate_key()[0] for _ in range(200)}
    assert len(generated) == 200


def test_every_single_character_change_fails_offline():
    raw, _, _ = keys.generate_key()
    for position in range(len(raw)):
        original = raw[position]
        replacement = "A" if original != "A" else "B"
        mutated = raw[:position] + replacement + raw[position + 1 :]
        assert not keys.is_well_formed(mutated), position
        with pytest.raises(keys.InvalidKeyFormat):
            keys.parse_key(mutated)


@hypothesis_settings(max_examples=200, deadline=None)
@given(position=st.integers(min_value=0, max_value=117), char=st.sampled_from(keys.BASE62 + "_-"))
def test_a_flipped_character_anywhere_fails_the_checksum(position, char):
    raw, _, _ = keys.generate_key()
    position %= len(raw)
    if raw[position] == char:
        return
    mutated = raw[:position] + char + raw[position + 1 :]
    with pytest.raises(keys.InvalidKeyFormat):
        keys.parse_key(mutated)


@pytest.mark.parametrize(
    "raw",
    [
        "",
        "kc_live_",
        "Bearer kc_live_x",
        "kc_live_" + "a" * 16 + "_" + "b" * 49,  # right shape, wrong checksum
        "kc_live_" + "a" * 15 + "_" + "b" * 50,
        "x" * 10_000,
        None,
        12345,
    ],
)
def test_malformed_inputs_are_refused(raw):
    with pytest.raises(keys.InvalidKeyFormat):
        keys.parse_key(raw)


def test_hash_is_hmac_sha256_under_the_pepper():
    _, _, secret = keys.generate_key()
    with override_settings(KCAAS_KEY_PEPPER="pepper-one"):
        first = keys.key_hash(secret)
        assert re.fullmatch(r"[0-9a-f]{64}", first)
        assert first == keys.key_hash(secret)
    with override_settings(KCAAS_KEY_PEPPER="pepper-two"):
        second = keys.key_hash(secret)
    assert first != second
    import hashlib

    assert first == hmac.new(b"pepper-one", secret.encode(), hashlib.sha256).hexdigest()
    assert first != hashlib.sha256(secret.encode()).hexdigest()


def test_empty_pepper_is_refused():
    with override_settings(KCAAS_KEY_PEPPER=""), pytest.raises(RuntimeError):
        keys.key_hash("x")


def test_verify_uses_constant_time_compare_for_right_wrong_and_unknown(monkeypatch):
    calls = []
    real = hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(keys.hmac, "compare_digest", spy)
    _, _, secret = keys.generate_key()
    stored = keys.key_hash(secret)
    assert keys.verify_secret(secret, stored) is True
    assert keys.verify_secret(secret[:-1] + ("A" if secret[-1] != "A" else "B"), stored) is False
    assert keys.verify_secret(secret, None) is False  # unknown public id: compared against the dummy hash
    assert len(calls) == 3
    assert calls[2][1] == keys.DUMMY_HASH
