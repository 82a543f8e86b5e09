"""The Lua scripts behind the shard leases (see :mod:`outboxkit.relay.ownership.redis_leases`).

Renewal and release are compare-and-set on the exact lease value, so a relay
never extends or deletes a lease it cannot prove is its own; the heartbeat
keeps the member set scored with Redis server time, so pod clocks never matter.

A lease is one key, or two while relays of an older version are live: the key
named by the outbox's identity and its *legacy* companion named by the bare
table (:mod:`outboxkit.runtime.rediskeys`). Both carry the same value and TTL
and are taken, renewed and released together in one script, so an older relay
(which sees only the legacy key) and this one never hold a shard at once.
"""

from __future__ import annotations

__all__ = ["ACQUIRE_LUA", "HEARTBEAT_LUA", "RELEASE_LUA", "RENEW_LUA"]


def _per_shard_script(body: str) -> str:
    """A Lua script that runs ``body`` for each shard's lease.

    KEYS: the lease keys of every shard, in order; ARGV[1]: ttl ms; then, per
    shard, its value and how many of the following KEYS are its keys (1 or 2).
    ``body`` sees ``ks`` (the shard's keys, the main one first) and ``value``
    and sets ``out[n]``: 1 = done, 0 = key missing, -1 = held by someone else.
    One more element follows the results: Redis's clock in ms. Scripts run one
    at a time, so these clocks order every acquire and release of a shard
    across relays (logged as ``redis_epoch_ms``).
    """
    return f"""
local out = {{}}
local k, a, n = 1, 2, 0
while a <= #ARGV do
  n = n + 1
  local value = ARGV[a]
  local ks = {{}}
  for j = 1, tonumber(ARGV[a + 1]) do ks[j] = KEYS[k]; k = k + 1 end
  a = a + 2
{body}end
local t = redis.call('TIME')
out[n + 1] = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return out
"""


RENEW_LUA = _per_shard_script(
    """  local mine, other = 0, 0
  for _, key in ipairs(ks) do
    local v = redis.call('GET', key)
    if v == value then mine = mine + 1 elseif v then other = other + 1 end
  end
  if mine == #ks then
    for _, key in ipairs(ks) do redis.call('PEXPIRE', key, ARGV[1]) end
    out[n] = 1
  elseif other > 0 then
    out[n] = -1
  else
    out[n] = 0
  end
"""
)
# Deletes each key that holds exactly ``value``; the result is the main key's.
RELEASE_LUA = _per_shard_script(
    """  out[n] = 0
  for j, key in ipairs(ks) do
    local v = redis.call('GET', key)
    if v == value then
      redis.call('DEL', key)
      if j == 1 then out[n] = 1 end
    elseif v and j == 1 then
      out[n] = -1
    end
  end
"""
)
# All keys or none: a key taken here is deleted again when its companion is held.
ACQUIRE_LUA = _per_shard_script(
    """  local done = {}
  out[n] = 1
  for _, key in ipairs(ks) do
    if redis.call('SET', key, value, 'NX', 'PX', ARGV[1]) then
      done[#done + 1] = key
    else
      out[n] = 0
      break
    end
  end
  if out[n] == 0 then
    for _, key in ipairs(done) do redis.call('DEL', key) end
  end
"""
)

# KEYS[1]: members zset; KEYS[2]: servers hash (node id -> server fingerprint);
# KEYS[3] (optional): the legacy members zset of older relays.
# ARGV[1]: node id; ARGV[2]: ttl ms; ARGV[3]: '1' join, '0' leave; ARGV[4]: fingerprint.
# Scores are expiry times in Redis server milliseconds, so pod clocks never matter.
# Returns {live members, their fingerprints (false when unknown), live legacy members}.
HEARTBEAT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if #gone > 0 then redis.call('HDEL', KEYS[2], unpack(gone)) end
if ARGV[3] == '1' then
  redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
  if ARGV[4] ~= '' then redis.call('HSET', KEYS[2], ARGV[1], ARGV[4]) end
else
  redis.call('ZREM', KEYS[1], ARGV[1])
  redis.call('HDEL', KEYS[2], ARGV[1])
end
redis.call('PEXPIRE', KEYS[1], ttl * 2)
if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('PEXPIRE', KEYS[2], ttl * 2) end
local members = redis.call('ZRANGE', KEYS[1], 0, -1)
local servers = {}
if #members > 0 then servers = redis.call('HMGET', KEYS[2], unpack(members)) end
local legacy = {}
if KEYS[3] then legacy = redis.call('ZRANGEBYSCORE', KEYS[3], '(' .. now, '+inf') end
return {members, servers, legacy}
"""
