"""librdkafka properties outboxkit treats specially: which hold secrets.

``SENSITIVE_KAFKA_PROPERTIES`` lists every property that can carry key material
or credentials. It contains the properties librdkafka itself flags as sensitive
(``_RK_SENSITIVE`` in ``src/rdkafka_conf.c``), the aliases and newer names that
carry the same material, and the OAUTHBEARER extensions (free-form key=value
pairs that usually carry tokens). Their values never reach a log line: the
start-up line shows ``***`` (see :func:`outboxkit.runtime.logs.is_secret_key`,
which also masks any property whose name says password, passphrase, secret,
token, credential or private key, so a future property is covered by its name).
``tests/runtime/test_kafkaconf.py`` checks the list against librdkafka's
configuration reference.
"""

from __future__ import annotations

__all__ = ["SENSITIVE_KAFKA_PROPERTIES"]

SENSITIVE_KAFKA_PROPERTIES: frozenset[str] = frozenset(
    {
        # TLS client key: the key itself, its location, its password.
        "ssl.key.pem",
        "ssl_key",
        "ssl.key.location",
        "ssl.key.password",
        "ssl.keystore.password",
        # librdkafka flags the CA PEM as sensitive; follow it.
        "ssl.ca.pem",
        # Client key of the HTTPS (OIDC) client, in librdkafka releases that have one.
        "https.client.key.pem",
        "https.client.key.location",
        "https.client.key.password",
        # SASL credentials.
        "sasl.username",
        "sasl.password",
        "sasl.oauthbearer.config",
        "sasl.oauthbearer.extensions",
        "sasl.oauthbearer.client.secret",
        "sasl.oauthbearer.client.credentials.client.secret",
        "sasl.oauthbearer.assertion.private.key.pem",
        "sasl.oauthbearer.assertion.private.key.file",
        "sasl.oauthbearer.assertion.private.key.passphrase",
    }
)
