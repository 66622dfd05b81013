"""The sealed per-cache hash key and the token signing key with its JWKS."""

import os
import stat
import threading
import uuid

import jwt
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from audit import keys as audit_keys
from caches import signing
from caches.sealing import HASH_KEY_NUM_BYTES, SealError, hash_key_new_sealed, hash_key_seal, hash_key_unseal


def test_sealed_key_opens_only_for_its_cache():
    cache_id, other = uuid.uuid4(), uuid.uuid4()
    key = os.urandom(HASH_KEY_NUM_BYTES)
    sealed = hash_key_seal(cache_id=cache_id, hash_key=key)
    assert key not in sealed and len(sealed) == 1 + 12 + 32 + 16
    assert hash_key_unseal(cache_id=str(cache_id), sealed=sealed) == key
    with pytest.raises(SealError):
        hash_key_unseal(cache_id=other, sealed=sealed)  # moved onto another row: does not open


def test_sealing_is_randomized_and_tamper_evident():
    cache_id = uuid.uuid4()
    a, b = hash_key_new_sealed(cache_id=cache_id), hash_key_new_sealed(cache_id=cache_id)
    assert a != b and hash_key_unseal(cache_id=cache_id, sealed=a) != hash_key_unseal(cache_id=cache_id, sealed=b)
    for position in (0, 5, 20, len(a) - 1):
        tampered = bytearray(a)
        tampered[position] ^= 1
        with pytest.raises(SealError):
            hash_key_unseal(cache_id=cache_id, sealed=bytes(tampered))


def test_sealed_key_needs_the_kek(settings):
    cache_id = uuid.uuid4()
    sealed = hash_key_new_sealed(cache_id=cache_id)
    settings.KCAAS_KEK = "another key-encryption key"
    with pytest.raises(SealError):
        hash_key_unseal(cache_id=cache_id, sealed=sealed)


def test_signing_key_file_is_created_once_with_mode_0600(tmp_path, settings):
    path = tmp_path / "secrets" / "token.pem"
    settings.KCAAS_TOKEN_SIGNING_KEY_PEM = ""
    settings.KCAAS_TOKEN_SIGNING_KEY_FILE = str(path)
    results = []
    barrier = threading.Barrier(4)

    def load():
        barrier.wait()
        results.append(audit_keys._load_or_create_file(path))

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1  # racing creators agree on one key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in path.parent.iterdir()] == ["token.pem"]  # no temporary file left behind
    assert (
        signing.public_jwk()["x"]
        == signing.public_jwk_of(serialization.load_pem_private_key(path.read_bytes(), None).public_key())["x"]
    )


def test_signing_key_from_pem_setting_wins(settings, tmp_path):
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ).decode()
    settings.KCAAS_TOKEN_SIGNING_KEY_PEM = pem
    settings.KCAAS_TOKEN_SIGNING_KEY_FILE = str(tmp_path / "unused.pem")
    token = signing.token_sign({"sub": "x"})
    assert jwt.decode(token, key.public_key(), algorithms=["EdDSA"]) == {"sub": "x"}
    assert not (tmp_path / "unused.pem").exists()


def test_kid_is_the_rfc7638_thumbprint():
    # RFC 8037 appendix A.3: the thumbprint of the example Ed25519 key.
    example = bytes.fromhex("d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a")
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    jwk = signing.public_jwk_of(Ed25519PublicKey.from_public_bytes(example))
    assert jwk["x"] == "11qYAYKxCrfVS_7TyWQHOg7hcvPapiMlrwIaaPcHURo"
    assert jwk["kid"] == "kPrK_qmxVWaYVA9wwBF6Iuo3vVzz7TxHCTwXBygrS4k"


@pytest.mark.django_db
def test_jwks_is_public_and_verifies_signed_tokens(client):
    response = client.get("/.well-known/jwks.json")
    assert response.status_code == 200
    assert "max-age" in response["Cache-Control"]
    (jwk,) = response.json()["keys"]
    assert jwk["kty"] == "OKP" and jwk["crv"] == "Ed25519" and jwk["alg"] == "EdDSA" and jwk["use"] == "sig"
    token = signing.token_sign({"hello": "node"})
    assert jwt.get_unverified_header(token)["kid"] == jwk["kid"]
    assert jwt.decode(token, jwt.PyJWK(jwk).key, algorithms=["EdDSA"]) == {"hello": "node"}
