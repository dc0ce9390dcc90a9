"""The Lua scripts of the Redis streams: each runs atomically in Redis, so what it checks
is still true when it writes (key names in :mod:`sluice.streams.redis_codec`).

Each script touches the keys of ONE cluster slot, so the same scripts run on one Redis
and on a Redis Cluster:

- :data:`APPEND` (a stream's slot; on one Redis, every stream of the round trip at once):
  the appends of one round trip of a replica's writer (:mod:`sluice.streams.redis_log`);
- :data:`ADMIT` (the registry's slot): count a new stream against the live-stream limits
  and the shared log-memory budget, and register it;
- :data:`CLOSE` (the registry's slot): take a stream out of those counts, once;
- :data:`REAP` (the stream's slot): end a stream whose producer's lease expired with one
  retryable error (:mod:`sluice.streams.redis_registry`).
"""

from __future__ import annotations

__all__ = ["ADMIT", "APPEND", "CLOSE", "REAP"]

# The appends of one round trip, for every stream in it: KEYS are pairs, each stream's log
# and record; ARGV is the record bound, then per stream a head ``<first seq> <number of
# events> <0|1> <grown>`` (1: the last event is terminal; grown: the bytes its log grew by
# since its last append was counted, added to the record's ``bytes``) and its events. Each
# stream's events are published on its channel as one message, ``<first seq> [<event>,...]``
# (redis_codec.decode_append). An entry id at or below the log's last (a lease already
# ended the stream) fails that stream's append: 0. One head argument, and a message built
# here, not sent: every argument costs the client more CPU to pack than Redis to read.
APPEND = """
local maxlen = ARGV[1]
local a = 2
local out = {}
for i = 1, #KEYS, 2 do
  local log = KEYS[i]
  local f, c, terminal, g = string.match(ARGV[a], '^(%d+) (%d+) ([01]) (%-?%d+)$')
  local first, n, grown = tonumber(f), tonumber(c), tonumber(g)
  a = a + 1
  local ok = 1
  for j = 0, n - 1 do
    local res
    if terminal == '1' and j == n - 1 then
      res = redis.pcall('XADD', log, 'MAXLEN', '~', maxlen, '0-' .. (first + j),
                        'e', ARGV[a + j], 't', '1')
    else
      res = redis.pcall('XADD', log, 'MAXLEN', '~', maxlen, '0-' .. (first + j),
                        'e', ARGV[a + j])
    end
    if type(res) == 'table' and res.err then
      ok = 0
      break
    end
  end
  if ok == 1 then
    local channel = (string.gsub(log, ':log$', ':events'))
    redis.call('PUBLISH', channel, f .. ' [' .. table.concat(ARGV, ',', a, a + n - 1) .. ']')
    if grown ~= 0 and redis.call('EXISTS', KEYS[i + 1]) == 1 then
      redis.call('HINCRBY', KEYS[i + 1], 'bytes', grown)
    end
  end
  a = a + n
  out[#out + 1] = ok
end
return out
"""

# Count, then register: the tenant's and the server's live streams, then the live
# streams' log bytes (of all, then of the tenant) against their bounds' full marks.
# KEYS: live, tenant live, leases, log bytes, tenant log bytes. ARGV: stream id, max
# streams, max per tenant, lease expiry (ms), tenant, budget full mark, tenant full mark,
# the bytes of an empty log.
ADMIT = """
if redis.call('SCARD', KEYS[2]) >= tonumber(ARGV[3]) then return 'tenant' end
if redis.call('SCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 'server' end
local empty = tonumber(ARGV[8])
local used = tonumber(redis.call('GET', KEYS[4]) or '0')
if used + empty > tonumber(ARGV[6]) then return 'log_memory' end
local mine = tonumber(redis.call('HGET', KEYS[5], ARGV[5]) or '0')
if mine + empty > tonumber(ARGV[7]) then return 'tenant_log_bytes' end
redis.call('SADD', KEYS[1], ARGV[1])
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[1])
redis.call('INCRBY', KEYS[4], empty)
redis.call('HINCRBY', KEYS[5], ARGV[5], empty)
return 'ok'
"""

# A stream leaves the live counts: its owner ended it, or a lease sweep did. Only the
# call that removes its lease takes it out, so two never both subtract its bytes.
# KEYS as ADMIT's; ARGV: stream id, tenant, the bytes its log was counted for.
CLOSE = """
if redis.call('ZREM', KEYS[3], ARGV[1]) == 0 then return 0 end
redis.call('SREM', KEYS[1], ARGV[1])
redis.call('SREM', KEYS[2], ARGV[1])
local n = tonumber(ARGV[3])
if n ~= 0 then
  if redis.call('DECRBY', KEYS[4], n) < 0 then redis.call('SET', KEYS[4], 0) end
  if redis.call('HINCRBY', KEYS[5], ARGV[2], -n) <= 0 then redis.call('HDEL', KEYS[5], ARGV[2]) end
end
return 1
"""

# An expired producer lease: end the stream with one retryable error, unless its log
# already ends (its last entry carries ``t``). KEYS: the stream's log and record. ARGV:
# stream id, the error event, the retention (s). Returns whether it ended the stream, and
# the record's tenant and counted bytes (for CLOSE).
REAP = """
local tenant = redis.call('HGET', KEYS[2], 'tenant') or ''
local bytes = redis.call('HGET', KEYS[2], 'bytes') or '0'
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
local seq = 0
if #last > 0 then
  local fields = last[1][2]
  for i = 1, #fields, 2 do
    if fields[i] == 't' then return {0, tenant, bytes} end
  end
  seq = tonumber(string.match(last[1][1], '-(%d+)$'))
end
seq = seq + 1
redis.call('XADD', KEYS[1], '0-' .. seq, 'e', ARGV[2], 't', '1')
redis.call('PUBLISH', 'sluice:{' .. ARGV[1] .. '}:events', seq .. ' [' .. ARGV[2] .. ']')
redis.call('HSET', KEYS[2], 'state', 'failed', 'finish_reason', 'error')
redis.call('EXPIRE', KEYS[2], ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[3])
return {1, tenant, bytes}
"""
