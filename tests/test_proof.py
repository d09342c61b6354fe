"""The proofs of :mod:`trainguard.core.proof` are plain HMAC-SHA256 of their
fields under each channel's key, however many keys a process uses at once
(each proof starts from a copy of its key's precomputed state: a copy of
the wrong key's state would let a server without the secret pass)."""

from __future__ import annotations

import hashlib
import hmac
import struct

from trainguard.core.proof import client_proof, derive, nonce, server_proof


def _reference(key: bytes, role: bytes, *parts: bytes) -> bytes:
    fields = b"".join(struct.pack("!H", len(p)) + p for p in parts)
    return hmac.new(key, role + b"\0" + fields, hashlib.sha256).digest()


def test_each_proof_is_the_hmac_of_its_fields_under_its_own_key():
    keys = [derive("secret-a", "control"), derive("secret-b", "control"), derive("secret-a", "peer")]
    assert len(set(keys)) == 3
    cn, sn, address = nonce(), nonce(), "127.0.0.1:29400"
    for _ in range(2):  # interleaved, twice: each key's state is reused, never another's
        for key in keys:
            assert server_proof(key, cn, sn, address) == _reference(key, b"server", cn, sn, address.encode())
            assert client_proof(key, sn, cn, address, b"/m") == _reference(key, b"client", sn, cn, address.encode(),
                                                                           b"/m")
    proofs = {server_proof(k, cn, sn, address) for k in keys} | {client_proof(k, sn, cn, address) for k in keys}
    assert len(proofs) == 6  # another key, or the other role, never yields the same proof
