"""The Lua scripts behind the shard leases (see :mod:`outboxkit.relay.leases`).

Renewal and release are compare-and-set on the exact lease value, so a relay
never extends or deletes a lease it cannot prove is its own; the heartbeat
keeps the member set scored with Redis server time, so pod clocks never matter.
"""

from __future__ import annotations

__all__ = ["ACQUIRE_LUA", "HEARTBEAT_LUA", "RELEASE_LUA", "RENEW_LUA"]


def _per_key_script(body: str) -> str:
    """A Lua script that runs ``body`` for each lease key.

    KEYS: lease keys; ARGV[1]: ttl ms; ARGV[i + 1]: the value for KEYS[i]. ``body``
    sees ``key`` and ``value`` and sets ``out[i]``: 1 = done, 0 = key missing,
    -1 = held by someone else. One more element follows the results: Redis's
    clock in ms. Scripts run one at a time, so these clocks order every acquire
    and release of a shard across relays (logged as ``redis_ms``).
    """
    return f"""
local out = {{}}
for i, key in ipairs(KEYS) do
  local value = ARGV[i + 1]
{body}end
local t = redis.call('TIME')
out[#KEYS + 1] = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return out
"""


def _compare_and(action: str) -> str:
    """``action`` only where the key holds exactly ``value``."""
    return f"""  local v = redis.call('GET', key)
  if v == value then
    {action}
    out[i] = 1
  elseif v then
    out[i] = -1
  else
    out[i] = 0
  end
"""


RENEW_LUA = _per_key_script(_compare_and("redis.call('PEXPIRE', key, ARGV[1])"))
RELEASE_LUA = _per_key_script(_compare_and("redis.call('DEL', key)"))
ACQUIRE_LUA = _per_key_script(
    """  if redis.call('SET', key, value, 'NX', 'PX', ARGV[1]) then
    out[i] = 1
  else
    out[i] = 0
  end
"""
)

# KEYS[1]: members zset; ARGV[1]: node id; ARGV[2]: ttl ms; ARGV[3]: '1' join, '0' leave.
# Scores are expiry times in Redis server milliseconds, so pod clocks never matter.
HEARTBEAT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if ARGV[3] == '1' then
  redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
else
  redis.call('ZREM', KEYS[1], ARGV[1])
end
redis.call('PEXPIRE', KEYS[1], ttl * 2)
return redis.call('ZRANGE', KEYS[1], 0, -1)
"""
