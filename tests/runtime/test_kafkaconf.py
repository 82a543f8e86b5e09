"""Every librdkafka property that can hold key material or credentials is masked.

Checked against librdkafka's configuration reference: ``data/librdkafka-CONFIGURATION.md``
is CONFIGURATION.md of confluentinc/librdkafka at commit 4c3b017c (v2.15.0 + 1;
the installed wheel bundles 2.16.0). A property whose name or description speaks
of passwords, passphrases, secrets, private keys, PEM, tokens, credentials or JWT
assertions must be masked, or be listed below as reviewed with the reason it holds
no secret; a new librdkafka property of that kind fails this test until it is
classified.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import re
from pathlib import Path

import pytest

from outboxkit.runtime import RuntimeSettings, describe, load
from outboxkit.runtime.kafkaconf import SENSITIVE_KAFKA_PROPERTIES
from outboxkit.runtime.logs import configure_logging, is_secret_key, log_event

pytestmark = pytest.mark.unit

REFERENCE = Path(__file__).parent / "data" / "librdkafka-CONFIGURATION.md"

#: Flagged ``_RK_SENSITIVE`` in src/rdkafka_conf.c at the same commit.
LIBRDKAFKA_SENSITIVE = (
    "ssl.key.location",
    "ssl.key.password",
    "ssl.key.pem",
    "ssl_key",
    "ssl.ca.pem",
    "ssl.keystore.password",
    "sasl.username",
    "sasl.password",
    "sasl.oauthbearer.config",
    "sasl.oauthbearer.client.secret",
    "sasl.oauthbearer.assertion.private.key.file",
    "sasl.oauthbearer.assertion.private.key.passphrase",
    "sasl.oauthbearer.assertion.private.key.pem",
)

_WORDS = re.compile(
    r"password|passphrase|secret|private key|\bkeys?\b|credential|token|sensitive|\bpem\b"
    r"|\bjwt\b|assertion",
    re.IGNORECASE,
)

#: Properties the words above match that hold no secret, with the reason.
REVIEWED_NOT_SECRET = {
    "ssl.cipher.suites": "cipher names",
    "ssl.certificate.location": "path of the public certificate",
    "ssl.certificate.pem": "public certificate",
    "ssl_certificate": "public certificate (internal object)",
    "ssl.ca.location": "path of public CA certificates",
    "https.ca.location": "path of public CA certificates",
    "https.ca.pem": "public CA certificates",
    "sasl.kerberos.min.time.before.relogin": "a duration",
    "enable.sasl.oauthbearer.unsecure.jwt": "a boolean",
    "oauthbearer_token_refresh_cb": "a callback, cannot be set from text",
    "sasl.oauthbearer.method": "an enum",
    "sasl.oauthbearer.client.credentials.client.id": "a public client id, like a user name",
    "sasl.oauthbearer.client.id": "a public client id, like a user name",
    "sasl.oauthbearer.token.endpoint.url": "a URL; a password in it is masked as URL userinfo",
    "sasl.oauthbearer.sub.claim.name": "a claim name",
    "sasl.oauthbearer.assertion.algorithm": "an algorithm name",
    "sasl.oauthbearer.assertion.file": "path of the assertion file",
    "sasl.oauthbearer.assertion.claim.aud": "a claim value",
    "sasl.oauthbearer.assertion.claim.exp.seconds": "a duration",
    "sasl.oauthbearer.assertion.claim.iss": "a claim value",
    "sasl.oauthbearer.assertion.claim.jti.include": "a boolean",
    "sasl.oauthbearer.assertion.claim.nbf.seconds": "a duration",
    "sasl.oauthbearer.assertion.claim.sub": "a claim value",
    "sasl.oauthbearer.assertion.jwt.template.file": "path of a template",
    "sasl.oauthbearer.metadata.authentication.type": "an enum",
    "sticky.partitioning.linger.ms": "a duration",
    "partitioner": "a partitioner name",
}


def _documented() -> dict[str, str]:
    """Property name -> description, from the reference's tables."""
    out: dict[str, str] = {}
    for line in REFERENCE.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) >= 6 and re.fullmatch(r"[a-z_][a-z0-9_.]*", cells[0]):
            out[cells[0]] = cells[-1]
    return out


def _needs_review() -> list[str]:
    return [
        name for name, text in _documented().items() if _WORDS.search(name) or _WORDS.search(text)
    ]


def test_the_reference_was_read() -> None:
    documented = _documented()
    assert len(documented) > 150
    assert "ssl.key.pem" in documented and "sasl.password" in documented


@pytest.mark.parametrize("name", _needs_review())
def test_every_property_that_may_hold_a_secret_is_masked_or_reviewed(name: str) -> None:
    if name in REVIEWED_NOT_SECRET:
        assert name not in SENSITIVE_KAFKA_PROPERTIES, "listed both ways"
        return
    assert is_secret_key(name), f"{name} may hold a secret and is not masked"


@pytest.mark.parametrize("name", LIBRDKAFKA_SENSITIVE)
def test_what_librdkafka_flags_sensitive_is_masked(name: str) -> None:
    assert name in SENSITIVE_KAFKA_PROPERTIES
    assert is_secret_key(name)


def test_the_list_names_real_properties() -> None:
    documented = _documented()
    newer = {"https.client.key.pem", "https.client.key.location", "https.client.key.password"}
    assert SENSITIVE_KAFKA_PROPERTIES - newer <= set(documented)


PEM = (
    "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\nsecretbody\n"
    "-----END PRIVATE KEY-----"
)


@pytest.mark.parametrize(
    "name",
    sorted(
        {*SENSITIVE_KAFKA_PROPERTIES, *(n for n in _needs_review() if n not in REVIEWED_NOT_SECRET)}
    ),
)
def test_start_line_masks_the_value(name: str) -> None:
    """What a user sees: the start-up line with describe(settings) never shows the value."""
    value = PEM if name.endswith("pem") else f"VaLuE-{name}-xyz"
    s = load(RuntimeSettings, environ={}, args=None)
    s = dataclasses.replace(s, kafka_config={name: value, "acks": "all"})
    stream = io.StringIO()
    configure_logging(service="outboxkit-relay", node_id="n", stream=stream)
    log_event(logging.getLogger("outboxkit.test"), "relay-started", settings=describe(s))
    line = stream.getvalue()
    record = json.loads(line.splitlines()[-1])
    assert record["settings"]["kafka_config"] == {name: "***", "acks": "all"}
    assert "secretbody" not in line and "VaLuE-" not in line
