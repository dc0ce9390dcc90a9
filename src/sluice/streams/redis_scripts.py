"""The Lua scripts of the Redis streams: each runs atomically in Redis, so what it checks
is still true when it writes (key names in :mod:`sluice.streams.redis_codec`).

- :data:`APPEND`: every append of one round trip of a replica's writer, for all its
  streams (:mod:`sluice.streams.redis_log`);
- :data:`ADMIT`: count a new stream against the live-stream limits and register it;
- :data:`REAP`: end a stream whose producer's lease expired with one retryable error
  (:mod:`sluice.streams.redis_hub`).

In a Redis Cluster, :data:`APPEND` would run once per slot among a round trip's streams,
and :data:`ADMIT` and :data:`REAP` touch server-wide keys beside the stream's own: they
assume one Redis (see the README).
"""

from __future__ import annotations

__all__ = ["ADMIT", "APPEND", "REAP"]

# The appends of one round trip, for every stream in it: KEYS are the streams' logs; ARGV
# is the record bound, then per stream its first seq, its number of events, whether the
# last one is terminal, the events, and the message to publish. An entry id at or below
# the log's last (a lease already ended the stream) fails that stream's append: 0.
APPEND = """
local maxlen = ARGV[1]
local a = 2
local out = {}
for i = 1, #KEYS do
  local first = tonumber(ARGV[a])
  local n = tonumber(ARGV[a + 1])
  local terminal = ARGV[a + 2]
  a = a + 3
  local ok = 1
  for j = 0, n - 1 do
    local res
    if terminal == '1' and j == n - 1 then
      res = redis.pcall('XADD', KEYS[i], 'MAXLEN', '~', maxlen, '0-' .. (first + j),
                        'e', ARGV[a + j], 't', '1')
    else
      res = redis.pcall('XADD', KEYS[i], 'MAXLEN', '~', maxlen, '0-' .. (first + j),
                        'e', ARGV[a + j])
    end
    if type(res) == 'table' and res.err then
      ok = 0
      break
    end
  end
  a = a + n
  if ok == 1 then
    local channel = (string.gsub(KEYS[i], ':log$', ':events'))
    redis.call('PUBLISH', channel, ARGV[a])
  end
  a = a + 1
  out[i] = ok
end
return out
"""

# Count, then register: the server's and the tenant's live streams, one atomic step.
ADMIT = """
if redis.call('SCARD', KEYS[2]) >= tonumber(ARGV[3]) then return 'tenant' end
if redis.call('SCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 'server' end
redis.call('SADD', KEYS[1], ARGV[1])
redis.call('SADD', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[3], unpack(ARGV, 6))
redis.call('EXPIRE', KEYS[3], ARGV[5])
redis.call('ZADD', KEYS[4], ARGV[4], ARGV[1])
return 'ok'
"""

# An expired producer lease: end the stream with one retryable error, unless its log
# already ends (its last entry carries ``t``) or another replica got here first.
REAP = """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) > tonumber(ARGV[2]) then return 0 end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('SREM', KEYS[4], ARGV[1])
local tenant = redis.call('HGET', KEYS[3], 'tenant')
if tenant then redis.call('SREM', 'sluice:tenant:' .. tenant .. ':live', ARGV[1]) end
local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
local seq = 0
if #last > 0 then
  local fields = last[1][2]
  for i = 1, #fields, 2 do
    if fields[i] == 't' then return 0 end
  end
  seq = tonumber(string.match(last[1][1], '-(%d+)$'))
end
seq = seq + 1
redis.call('XADD', KEYS[2], '0-' .. seq, 'e', ARGV[3], 't', '1')
redis.call('PUBLISH', 'sluice:{' .. ARGV[1] .. '}:events', seq .. ' [' .. ARGV[3] .. ']')
redis.call('HSET', KEYS[3], 'state', 'failed', 'finish_reason', 'error')
redis.call('EXPIRE', KEYS[3], ARGV[4])
redis.call('EXPIRE', KEYS[2], ARGV[4])
return 1
"""
