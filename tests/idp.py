"""An OpenID Connect provider as far as a broker sees one: key pairs generated here,
published as a JWKS, and JWTs signed with them (PyJWT), for the OIDC tests."""

from __future__ import annotations

import json
import time
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, rsa

ISSUER = "https://idp.example.test/realms/gpufed"
AUDIENCE = "gpufed-broker"


class Provider:
    """An OIDC provider as far as the broker sees one: its keys, published as a JWKS."""

    def __init__(self) -> None:
        self.keys: dict[str, Any] = {}  # kid -> private key
        self.published: list[str] = []  # the kids the JWKS shows
        self.fetches = 0
        self.delay = 0.0  # seconds the JWKS takes to answer

    def add(self, kid: str, *, curve: bool = False, publish: bool = True) -> None:
        self.keys[kid] = (
            ec.generate_private_key(ec.SECP256R1())
            if curve
            else rsa.generate_private_key(public_exponent=65537, key_size=2048)
        )
        if publish:
            self.published.append(kid)

    def jwks(self) -> dict[str, Any]:
        found = []
        for kid in self.published:
            key = self.keys[kid]
            algorithm = jwt.algorithms.ECAlgorithm if _is_ec(key) else jwt.algorithms.RSAAlgorithm
            data = json.loads(algorithm.to_jwk(key.public_key()))
            data.update(kid=kid, use="sig", alg="ES256" if _is_ec(key) else "RS256")
            found.append(data)
        return {"keys": found}

    def token(self, kid: str = "k1", *, lifetime: float = 300, **claims: Any) -> str:
        now = int(time.time())
        body = {
            "iss": ISSUER,
            "aud": AUDIENCE,
            "sub": "u-123",
            "preferred_username": "alice",
            "iat": now,
            "exp": now + int(lifetime),
            "groups": ["gpufed:team-a:submitter"],
            **claims,
        }
        key = self.keys[kid]
        algorithm = "ES256" if _is_ec(key) else "RS256"
        return jwt.encode(body, key, algorithm=algorithm, headers={"kid": kid})


def _is_ec(key: Any) -> bool:
    return isinstance(key, ec.EllipticCurvePrivateKey)
