"""One setting's value: the names an operator sets it by, the parsers of its text,
and the checks of what the text parsed into.

Kept apart from the field machinery (:mod:`outboxkit.runtime.settingfields`) so
that the rules a value follows (what ``500ms`` means, which integers are taken,
how a problem names the flag and the variable) read in one place, and so that a
component's own cross-setting checks can name settings without pulling in the
loader. Re-exported from :mod:`outboxkit.runtime.settings`, but for the
parsers that only the field machinery and the loader call (``parse_int``,
``parse_str``, ``parse_csv``, ``parse_pair``, ``parse_pairs_env``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

ENV_PREFIX = "OUTBOXKIT_"


# -- names -----------------------------------------------------------------


def flag_name(field_name: str) -> str:
    """``lease_ttl`` -> ``--lease-ttl``."""
    return "--" + field_name.replace("_", "-")


def env_name(field_name: str) -> str:
    """``lease_ttl`` -> ``OUTBOXKIT_LEASE_TTL``."""
    return ENV_PREFIX + field_name.upper()


def where(field_name: str) -> str:
    """How an operator sets a setting: ``--lease-ttl / OUTBOXKIT_LEASE_TTL``."""
    return f"{flag_name(field_name)} / {env_name(field_name)}"


def invalid(field_name: str, reason: str) -> str:
    """A problem with a setting's value, naming its flag and its variable:
    ``invalid --lease-ttl / OUTBOXKIT_LEASE_TTL: <reason>``. For the checks a
    ``validate()`` makes across settings (one setting's ``validate=`` cannot)."""
    return f"invalid {where(field_name)}: {reason}"


def missing(field_name: str, detail: str = "") -> str:
    """A required setting left unset: ``missing --db-url / OUTBOXKIT_DB_URL<detail>``."""
    return f"missing {where(field_name)}{detail}"


# -- parsers ---------------------------------------------------------------

_DURATION_RE = re.compile(
    r"\s*(?P<num>[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)\s*(?P<unit>ms|s|m|h)?\s*",
    re.ASCII,
)
_UNIT_SECONDS = {None: 1.0, "s": 1.0, "ms": 0.001, "m": 60.0, "h": 3600.0}
_TRUE = frozenset({"1", "true", "yes", "on", "y", "t"})
_FALSE = frozenset({"0", "false", "no", "off", "n", "f"})


#: Longest duration any setting accepts (7 days): every wait, sleep and lease the
#: settings drive stays well inside what threads, timers and SQL intervals take.
MAX_DURATION_S = 7 * 86400.0
#: Largest integer setting: MySQL's signed INT, which bounds row counts and LIMITs.
MAX_INT = 2**31 - 1
_INT_RE = re.compile(r"\s*[-+]?[0-9]+\s*", re.ASCII)


def parse_duration(text: str) -> float:
    """Seconds as float: ``"1.5"``, ``"500ms"``, ``"2s"``, ``"1m"``, ``"1h"``.

    Refuses what no timer can honour: ``inf``/``1e999``, and anything above
    :data:`MAX_DURATION_S`.
    """
    m = _DURATION_RE.fullmatch(text)
    if not m:
        raise ValueError("must be a number of seconds or a duration like 500ms, 2s, 1m")
    seconds = float(m.group("num")) * _UNIT_SECONDS[m.group("unit")]
    if not math.isfinite(seconds) or abs(seconds) > MAX_DURATION_S:
        raise ValueError(f"must be at most {MAX_DURATION_S:g} s (7 days)")
    return seconds


def parse_bool(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError("must be one of 1/0, true/false, yes/no, on/off")


def parse_int(text: str) -> int:
    """An ``int`` setting, within :data:`MAX_INT`."""
    # ASCII digits only: int() also takes '١٢' and '1_000'.
    if not _INT_RE.fullmatch(text):
        raise ValueError("must be an integer")
    value = int(text)
    if abs(value) > MAX_INT:
        raise ValueError(f"must be at most {MAX_INT}")
    return value


def parse_str(text: str) -> str:
    return text


def parse_csv(text: str) -> tuple[str, ...]:
    """A ``tuple[str, ...]`` setting: comma-separated, blanks dropped."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def parse_pair(item: str) -> tuple[str, str]:
    """One ``key=value`` (a ``dict[str, str]`` setting's flag takes one per use)."""
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError("must be key=value")
    return key, value.strip()


#: ``name=`` at the start of a piece: a librdkafka property name (lower case, dotted).
_PROPERTY_START = re.compile(r"\s*([a-z][a-z0-9_]*(?:\.[a-z0-9_]+)*)\s*=")
#: Properties whose value is itself a comma list of ``k=v`` pairs.
_PAIR_LIST_VALUES = frozenset({"sasl.oauthbearer.config", "sasl.oauthbearer.extensions"})


def several_pairs_problem(flag: str, env: str, item: str) -> str | None:
    """A flag value that holds several ``k=v`` (``acks=all,linger.ms=5``), as the
    variable takes them: the flag takes one per use, and librdkafka would get
    ``all,linger.ms=5`` for ``acks``. Names the properties, never their values
    (one may be a password)."""
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or key in _PAIR_LIST_VALUES:
        return None
    names = [key]
    for piece in value.split(",")[1:]:
        found = _PROPERTY_START.match(piece)
        if found:
            names.append(found.group(1))
    if len(names) < 2:
        return None
    repeated = " ".join(f"{flag} {n}=..." for n in names)
    return (
        f"invalid {flag} / {env}: {flag} takes one property per use, this one holds "
        f"{len(names)} ({', '.join(names)}): repeat the flag ({repeated}); the "
        f"variable {env} is the one that takes a comma list"
    )


def parse_pairs_env(text: str) -> dict[str, str]:
    """``"k=v,k2=v2"``. A piece without ``=`` continues the previous value, so
    ``bootstrap.servers=a:9092,b:9092,acks=all`` keeps both brokers.
    """
    out: dict[str, str] = {}
    last: str | None = None
    for piece in text.split(","):
        if not piece.strip():
            continue
        if "=" not in piece and last is not None:
            out[last] = f"{out[last]},{piece.strip()}"
            continue
        key, value = parse_pair(piece)
        out[key] = value
        last = key
    return out


# -- validators --------------------------------------------------------------


def positive(value: float) -> str | None:
    return None if value > 0 else "must be > 0"


def non_negative(value: float) -> str | None:
    return None if value >= 0 else "must be >= 0"


def port_number(value: int) -> str | None:
    return None if 0 <= value <= 65535 else "must be a port number between 0 and 65535"


def at_least_one(value: int) -> str | None:
    return None if value >= 1 else "must be >= 1"


def retry_backoff_problem(base: float, cap: float) -> str | None:
    """The one check of ``--retry-backoff-base`` against ``--retry-backoff-cap``,
    for every service that backs off (the relay's rows, the consumer's handlers)."""
    if cap >= base:
        return None
    return invalid("retry_backoff_cap", f"must be >= --retry-backoff-base ({cap:g} < {base:g})")


#: Shortest start-up wait for a dependency: below it no real connection (DNS, TCP,
#: TLS, a first request) can be expected to finish, and the database drivers count
#: their connect timeouts in whole seconds anyway.
MIN_CONNECT_TIMEOUT_S = 1.0


def connect_timeout_problem(value: float) -> str | None:
    """``--connect-timeout``: at least :data:`MIN_CONNECT_TIMEOUT_S`. A smaller one
    (``0.001``, ``1e-320``) was accepted and then read as "unreachable" against a
    dependency that was up."""
    if value >= MIN_CONNECT_TIMEOUT_S:
        return None
    return (
        f"must be at least {MIN_CONNECT_TIMEOUT_S:g} s: no connection to Kafka or a "
        "database completes sooner, and the start would report it unreachable"
    )


def at_most(limit: float) -> Callable[[float], str | None]:
    """Validator: ``value <= limit``."""

    def check(value: float) -> str | None:
        return None if value <= limit else f"must be at most {limit:g}"

    return check
