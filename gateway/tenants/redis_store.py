"""Rate-limit counters and concurrency slots in Redis, changed only by atomic Lua scripts.

Every replica runs the same scripts against the same keys, so N replicas enforce one limit. Time inside the
scripts is Redis's own (``TIME``), so the replicas' clocks do not need to agree.

No request waits on Redis longer than ``timeout_s``: a call that fails or times out marks Redis *down*, and
while it is down calls fail at once (the caller falls back or refuses, per ``on_failure``) until a background
probe sees it answer again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError, ResponseError

from gateway.admission.queue import STANDARD
from gateway.config import RedisConfig
from gateway.tenants.ratelimit import LimitState, RateDecision, RateLimits

log = logging.getLogger("kvgate.redis")

T = TypeVar("T")

# A token bucket per key, the same arithmetic as gateway.tenants.ratelimit.TokenBucket: capacity per 60 s.
# ARGV: rpm (0 = unlimited), tpm (0 = unlimited), tokens to charge, the charge record's TTL (ms).
# Returns {allowed, requests left, tokens left, request wait s, token wait s (-1 = never fits)}.
# Each dimension keeps its level, when it was computed, and the capacity it was computed for ('r','rt','rc';
# 't','tt','tc'). As in the in-process RateLimiter: a bucket that does not exist yet starts full (a new key, a
# limit added by a reload), a resized one keeps what was used (TokenBucket.resize), and an unlimited dimension
# keeps no bucket, so a limit added later starts full rather than from a stored 0. A key written before the
# capacity was stored is taken to be at the current capacity.
# KEYS[2], the charge's record ("requests tokens" it took): what a refund may give back, once. It is kept as
# long as a request may last (CHARGE_RECORD_TTL_S), not the minute a bucket takes to refill: a busy tenant's
# bucket never refills by itself, and a charge settled after two minutes in the queue and a long stream owes
# what it did not use all the same. A record that says "undone" is a refund that came first (this check was
# late): it charges nothing.
CHARGE_RECORD_TTL_S = 3600
_CHARGE_RECORD_TTL_MS = CHARGE_RECORD_TTL_S * 1000
_CHECK = """
local key = KEYS[1]
local rpm, tpm, tokens = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if KEYS[2] and redis.call('GET', KEYS[2]) == 'undone' then
  redis.call('DEL', KEYS[2])
  return {0, '0', '0', '0', '0'}
end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local v = redis.call('HMGET', key, 'r', 'rt', 'rc', 't', 'tt', 'tc')
local function level(lvl, ts, old, cap)
  if cap <= 0 then return 0 end
  if not lvl then return cap end
  lvl, ts, old = tonumber(lvl), tonumber(ts), tonumber(old) or cap
  if old <= 0 then return cap end
  if now > ts then lvl = lvl + (now - ts) * old / 60 end
  lvl = math.min(old, lvl)
  if old ~= cap then lvl = math.min(cap, math.max(math.min(lvl, 0), cap - (old - lvl))) end  -- a debt stays one
  return lvl
end
local r, tk = level(v[1], v[2], v[3], rpm), level(v[4], v[5], v[6], tpm)
local rwait, twait = 0, 0
if rpm > 0 and r < 1 then rwait = (1 - r) * 60 / rpm end
if tpm > 0 and tk < tokens then
  if tokens > tpm then twait = -1 else twait = (tokens - tk) * 60 / tpm end
end
local allowed = 0
if rwait == 0 and twait == 0 then
  allowed = 1
  if rpm > 0 then r = r - 1 end
  if tpm > 0 then tk = tk - tokens end
  if KEYS[2] then
    local took = (rpm > 0 and 1 or 0) .. ' ' .. (tpm > 0 and tokens or 0)
    redis.call('SET', KEYS[2], took, 'PX', ARGV[4])
  end
end
-- a level is as of the later of now and its stamp: a clock stepped back (a failover) credits no time twice
local function stamp(ts) return math.max(now, tonumber(ts) or now) end
if rpm > 0 then
  redis.call('HSET', key, 'r', tostring(r), 'rt', tostring(stamp(v[2])), 'rc', tostring(rpm))
else
  redis.call('HDEL', key, 'r', 'rt', 'rc')
end
if tpm > 0 then
  redis.call('HSET', key, 't', tostring(tk), 'tt', tostring(stamp(v[5])), 'tc', tostring(tpm))
else
  redis.call('HDEL', key, 't', 'tt', 'tc')
end
-- kept until full again: a minute, or longer while the tokens are in debt (a refund that took more: _REFUND)
local keep = 61000
if tpm > 0 and tk < 0 then keep = math.max(keep, math.ceil((tpm - tk) * 60000 / tpm) + 1000) end
redis.call('PEXPIRE', key, keep)
return {allowed, tostring(r), tostring(tk), tostring(rwait), tostring(twait)}
"""

# Give back to a charge's buckets, once (KEYS[2], its record, goes): what the request did not use (ARGV:
# rpm, tpm, requests, tokens, '0', the record's TTL in ms), never more than the record says it took; or the
# whole charge ('1': undo, for a check whose answer never came). An undo finding no record leaves one that
# says "undone", so a check still on its way charges nothing. Amounts go back at the capacity the bucket was
# last charged with (as TokenBucket.refund does; the next check resizes it); rpm and tpm are for a key written
# before the capacity was stored. Tokens below 0 are taken (a charge cut to a minute's allowance used more:
# TokenBucket.take): the level goes into debt, from a full bucket if it had expired, and the key is kept until
# the debt is paid off and the bucket full again.
_REFUND = """
local key = KEYS[1]
local record = redis.call('GET', KEYS[2])
if not record then
  if ARGV[5] == '1' then redis.call('SET', KEYS[2], 'undone', 'PX', ARGV[6]) end
  return 0
end
if record == 'undone' then return 0 end
redis.call('DEL', KEYS[2])
local took_r, took_t = string.match(record, '^(%S+) (%S+)$')
took_r, took_t = tonumber(took_r), tonumber(took_t)
local requests, tokens = took_r, took_t
if ARGV[5] ~= '1' then
  requests, tokens = math.min(tonumber(ARGV[3]), took_r), math.min(tonumber(ARGV[4]), took_t)
  if took_t == 0 then tokens = 0 end  -- no token limit when it was charged: none to give back or take
end
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local function refund(field, stamp, stored_cap, per_minute, amount)
  if amount == 0 then return end
  local v = redis.call('HMGET', key, field, stamp, stored_cap)
  local cap = tonumber(v[3]) or per_minute
  if not cap or cap <= 0 then return end
  local level, ts = tonumber(v[1]), tonumber(v[2])
  if not level then
    if amount > 0 then return end  -- gone (full, expired): nothing to give back to
    level, ts = cap, now
  end
  if now > ts then level = level + (now - ts) * cap / 60 end
  level = math.min(cap, level + amount)
  redis.call('HSET', key, field, tostring(level), stamp, tostring(math.max(now, ts)), stored_cap, tostring(cap))
  local keep = math.max(61000, math.ceil((cap - level) * 60000 / cap) + 1000)  -- until full again
  if redis.call('PTTL', key) < keep then redis.call('PEXPIRE', key, keep) end
end
refund('r', 'rt', 'rc', tonumber(ARGV[1]), requests)
refund('t', 'tt', 'tc', tonumber(ARGV[2]), tokens)
return 1
"""

# A concurrency slot is a member of a sorted set scored by its lease expiry (ms, Redis time): a replica that
# dies without releasing loses its slots when the lease runs out. ARGV: limit, member, lease ms. KEYS[2], the
# member's release mark: a release that came first (its acquire timed out on the way, was given back at once,
# and ran late) leaves one, and the late acquire takes nothing, or its member would hold a slot for a lease.
_ACQUIRE = """
local key = KEYS[1]
local limit, member, lease = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
if redis.call('DEL', KEYS[2]) == 1 then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
if redis.call('ZSCORE', key, member) then return 1 end
if redis.call('ZCARD', key) < limit then
  redis.call('ZADD', key, now + lease, member)
  if redis.call('PTTL', key) < lease * 2 then redis.call('PEXPIRE', key, lease * 2) end
  return 1
end
return 0
"""

# Give a slot back (KEYS[1] the set, KEYS[2] the member's release mark; ARGV: member, lease ms, '1' to leave the
# mark whatever). The mark stays for a lease: an acquire of the member still on its way takes nothing
# (_ACQUIRE), and neither does a renewal that left before the release and lands after it (_RENEW), or either
# would hold the slot for a whole lease. Left when the member is not there yet (its acquire may be on its way),
# or when the caller asks (a renewal of it timed out: it may still land).
_RELEASE = """
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 or ARGV[3] == '1' then
  redis.call('SET', KEYS[2], '1', 'PX', ARGV[2])
end
return 1
"""

# Extend the leases of slots this replica still holds. KEYS: sets, then each member's release mark (a member
# released since is not put back); ARGV: lease ms, then one member per set.
# A plain ZADD, not XX: a slot whose lease lapsed (Redis restarted or unreachable, a late renewal) is still held
# by a running request, and must be counted again, or the other replicas admit past the limit on its account.
# If one of them took the freed place meanwhile, the set is over the limit for a while and admits no one until
# it is back under: the excess is one lapse's worth and ends, instead of lasting as long as the request.
_RENEW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease = tonumber(ARGV[1])
local n = #KEYS / 2
for i = 1, n do
  local key = KEYS[i]
  if redis.call('EXISTS', KEYS[n + i]) == 0 then
    redis.call('ZADD', key, now + lease, ARGV[i + 1])
    if redis.call('PTTL', key) < lease * 2 then redis.call('PEXPIRE', key, lease * 2) end
  end
end
return n
"""


# Blocks in flight on one engine, per reservation of every replica. KEYS[1]: a sorted set (member -> lease expiry,
# ms, Redis time); KEYS[2]: a hash (member -> the reservation's blocks); KEYS[3]: a hash (member -> "shown
# process tokens [shown tokens]": how many of those blocks the claimant's last sample of the engine shows, and
# which sample that was: the engine's process start time and the tokens it had processed; then the same of the
# sample before, if of the same process). Members are "<replica>:<reservation>". ``others`` sums the other
# replicas' unexpired members as a sample of the engine (``process``, ``tokens``; process '' for none) sees
# them: less what they showed of themselves in the latest of their samples no newer than that one (the
# engine's counters order its samples), whole if none is. The sample before is there because the replicas'
# scrapes interleave: half the time the other's latest is newer than this one's, its previous one older.
# KEYS[4]: a hash (replica prefix -> "expiry since blocks class [since blocks class ...]": the first requests
# of its queue in serving order, each waiting since ``since``, ms Redis time, needing ``blocks``, of priority
# ``class`` (0 = critical); the entry lapses at ``expiry``). Another replica's queued request that goes before
# ``mine`` (this replica's head, or the request it claims for: since, class) counts as held: one of a higher
# class, or of the same class waiting since earlier. The engines serve the replicas' queues as one queue, in
# the order each serves its own, rather than each replica refilling the room its own requests free.
# KEYS[5]: a hash (replica prefix -> "seq peak upto expiry": the most its reservations up to id ``upto`` can
# hold at one future moment, as its own ledger projected them decoding in lockstep when it took its restate
# number ``seq``; a restate older than the one stored is ignored).
# Weighed without a sample (whole claims), a replica with a live peak counts as that peak plus its members
# above ``upto`` (claimed since), whole: its members up to ``upto`` are in the peak whether or not Redis still
# has them, and a late or stale peak only counts for more. The sum over replicas of their peaks bounds the peak
# of their union, so each replica counts the others as it counts itself.
_OTHERS = """
local function parse_shown(entry)  -- shown, process, tokens, and the sample before's shown, tokens ('' if none)
  return string.match(entry, '^(%S+) (%S+) (%S+) ?(%S*) ?(%S*)$')
end
-- What a member showed in the latest of its samples no newer than (process, tokens); 0 if none is.
local function shown_by(entry, process, tokens)
  local n, p, t, pn, pt = parse_shown(entry)
  if p ~= process then return 0 end
  if tonumber(t) <= tokens then return tonumber(n) end
  if pn ~= '' and tonumber(pt) <= tokens then return tonumber(pn) end
  return 0
end
local function older_heads(waiting, prefix, now, mine, mine_class)
  local sum = 0
  local all = redis.call('HGETALL', waiting)
  for i = 1, #all, 2 do
    local expiry, queued = string.match(all[i + 1], '^(%S+)(.*)$')
    if tonumber(expiry) <= now then
      redis.call('HDEL', waiting, all[i])
    elseif all[i] ~= prefix then
      for since, need, class in string.gmatch(queued, '(%S+) (%S+) (%S+)') do
        local c = tonumber(class)
        if c < mine_class or (c == mine_class and tonumber(since) < mine) then sum = sum + tonumber(need) end
      end
    end
  end
  return sum
end
-- A claim granted: the queued request it was (of its class, the one nearest ``mine``, within 250 ms) waits
-- no more.
local function left_queue(waiting, prefix, mine, mine_class)
  local entry = redis.call('HGET', waiting, prefix)
  if not entry then return end
  local expiry, queued = string.match(entry, '^(%S+)(.*)$')
  local nearest, gap = nil, 250
  for since, class in string.gmatch(queued, '(%S+) %S+ (%S+)') do
    local off = math.abs(tonumber(since) - mine)
    if tonumber(class) == mine_class and off <= gap then nearest, gap = since, off end
  end
  if not nearest then return end
  local kept, dropped = expiry, false
  for since, need, class in string.gmatch(queued, '(%S+) (%S+) (%S+)') do
    if since == nearest and tonumber(class) == mine_class and not dropped then
      dropped = true
    else
      kept = kept .. ' ' .. since .. ' ' .. need .. ' ' .. class
    end
  end
  redis.call('HSET', waiting, prefix, kept)
end
local function others(leases, blocks, sampled, peaks, prefix, now, process, tokens)
  local expired = redis.call('ZRANGEBYSCORE', leases, '-inf', now)
  for _, member in ipairs(expired) do  -- one by one: unpack() has a limit, and a dead replica may leave many
    redis.call('HDEL', blocks, member)
    redis.call('HDEL', sampled, member)
  end
  redis.call('ZREMRANGEBYSCORE', leases, '-inf', now)
  local shown = {}
  if process ~= '' then
    local all = redis.call('HGETALL', sampled)
    for i = 1, #all, 2 do shown[all[i]] = all[i + 1] end
  end
  local peak, upto = {}, {}  -- weighed whole: each replica's live peak, and the newest reservation in it
  local all_peaks = redis.call('HGETALL', peaks)
  for i = 1, #all_peaks, 2 do  -- expired ones go whatever the mode, or every replica started would stay
    local _, p, u, expiry = string.match(all_peaks[i + 1], '^(%S+) (%S+) (%S+) (%S+)$')
    if tonumber(expiry) <= now then
      redis.call('HDEL', peaks, all_peaks[i])
    elseif process == '' and all_peaks[i] ~= prefix then
      peak[all_peaks[i]], upto[all_peaks[i]] = tonumber(p), tonumber(u)
    end
  end
  local sum = 0
  for _, p in pairs(peak) do sum = sum + p end
  -- blocks without a lease (the leases key was evicted, or lost alone) would never expire: gone now. Only
  -- looked for when there are more blocks than leases, which a claim or restate never leaves
  local orphans = redis.call('HLEN', blocks) > redis.call('ZCARD', leases)
  local all = redis.call('HGETALL', blocks)
  for i = 1, #all, 2 do
    local member = all[i]
    if orphans and not redis.call('ZSCORE', leases, member) then
      -- no lease (the leases key was evicted, or lost alone): nothing would ever expire it, so it goes now
      redis.call('HDEL', blocks, member)
      redis.call('HDEL', sampled, member)
    elseif string.sub(member, 1, #prefix) ~= prefix then
      local replica = string.match(member, '^(.*:)')
      local held = tonumber(all[i + 1])
      if shown[member] then held = held - shown_by(shown[member], process, tokens) end
      if not upto[replica] or tonumber(string.sub(member, #replica + 1)) > upto[replica] then
        sum = sum + held
      end
    end
  end
  return sum
end
local function expire(lease)
  for _, key in ipairs(KEYS) do  -- never shortened: another replica's lease may be longer (mid-rollout)
    if redis.call('PTTL', key) < lease * 2 then redis.call('PEXPIRE', key, lease * 2) end
  end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# Claim ``blocks`` for a new reservation if the other replicas' blocks, as this replica's sample sees them, and
# their queued requests that go before this one fit under ``limit`` (what this replica's own projection
# leaves for them). ARGV: prefix, member, blocks, limit, lease ms, process, tokens, ms this request has waited,
# its class. A claim granted takes its request out of this replica's waiting entry. Returns {claimed, others}.
_CLAIM = (
    _OTHERS
    + """
local prefix, member, blocks, limit, lease = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local mine, mine_class = now - tonumber(ARGV[8]), tonumber(ARGV[9])
local sum = others(KEYS[1], KEYS[2], KEYS[3], KEYS[5], prefix, now, ARGV[6], tonumber(ARGV[7]))
sum = sum + older_heads(KEYS[4], prefix, now, mine, mine_class)
if sum > limit then return {0, sum} end
redis.call('ZADD', KEYS[1], now + lease, member)
redis.call('HSET', KEYS[2], member, blocks)
redis.call('HDEL', KEYS[3], member)
left_queue(KEYS[4], prefix, mine, mine_class)
expire(lease)
return {1, sum}
"""
)

# Restate this replica's members: leases renewed, and how much of each its latest sample (process, tokens)
# shows; 0 blocks removes one. ARGV: prefix, lease ms, everything (1: this replica's members not listed are
# removed too), process, tokens, the first requests of its queue in serving order ("ttl-ms waited-ms blocks
# class [waited-ms blocks class ...]", or '' for none: its waiting entry is set to them), "seq peak" (its
# restate number and its reservations' peak, '' for none), the newest reservation it knew of (the peak's
# ``upto``; with everything, a member of its not listed is removed only up to that one: a claim made after the
# restate was taken, and landed before it, stays), then member, blocks, shown triples. Returns the other
# replicas' sum, with their queued requests that go before this replica's head (or, its queue empty, all of
# them: before whatever arrives now).
_RESTATE = (
    _OTHERS
    + """
local prefix, lease, everything = ARGV[1], tonumber(ARGV[2]), ARGV[3] == '1'
local process, tokens = ARGV[4], tonumber(ARGV[5])
local mine, mine_class = now, 1000
local ttl, queued = string.match(ARGV[6], '^(%S+)(.*)$')
if ttl then
  local entry = tostring(now + tonumber(ttl))
  for waited, need, class in string.gmatch(queued, '(%S+) (%S+) (%S+)') do
    local since = now - tonumber(waited)
    if mine_class == 1000 then mine, mine_class = since, tonumber(class) end  -- the head: served first here
    entry = entry .. ' ' .. since .. ' ' .. need .. ' ' .. class
  end
  redis.call('HSET', KEYS[4], prefix, entry)
else
  redis.call('HDEL', KEYS[4], prefix)
end
local seq, peak = string.match(ARGV[7], '^(%S+) (%S+)$')
if seq then
  local stored = redis.call('HGET', KEYS[5], prefix)
  local stored_seq = stored and tonumber(string.match(stored, '^(%S+)'))
  if not stored_seq or stored_seq < tonumber(seq) then
    redis.call('HSET', KEYS[5], prefix, seq .. ' ' .. peak .. ' ' .. ARGV[8] .. ' ' .. (now + lease))
  end
end
local function remove(member)
  redis.call('ZREM', KEYS[1], member)
  redis.call('HDEL', KEYS[2], member)
  redis.call('HDEL', KEYS[3], member)
end
if everything then
  local listed, upto = {}, tonumber(ARGV[8])
  for i = 9, #ARGV, 3 do listed[ARGV[i]] = true end
  for _, member in ipairs(redis.call('HKEYS', KEYS[2])) do
    if string.sub(member, 1, #prefix) == prefix and not listed[member]
        and tonumber(string.sub(member, #prefix + 1)) <= upto then
      remove(member)
    end
  end
end
for i = 9, #ARGV, 3 do
  local member, blocks, shown = ARGV[i], tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  if blocks > 0 then
    redis.call('ZADD', KEYS[1], now + lease, member)
    redis.call('HSET', KEYS[2], member, blocks)
    if shown > 0 and process ~= '' then
      local entry = shown .. ' ' .. process .. ' ' .. ARGV[5]
      local before = redis.call('HGET', KEYS[3], member)
      if before then  -- keep the sample before this one (or, restated at the same sample, the one before that)
        local n, p, t, pn, pt = parse_shown(before)
        if p == process and tonumber(t) < tokens then
          entry = entry .. ' ' .. n .. ' ' .. t
        elseif p == process and pn ~= '' then
          entry = entry .. ' ' .. pn .. ' ' .. pt
        end
      end
      redis.call('HSET', KEYS[3], member, entry)
    else
      redis.call('HDEL', KEYS[3], member)
    end
  else
    remove(member)
  end
end
expire(lease)
local held = others(KEYS[1], KEYS[2], KEYS[3], KEYS[5], prefix, now, process, tokens)
return held + older_heads(KEYS[4], prefix, now, mine, mine_class)
"""
)

# What the probe writes before it calls Redis usable again: two keys, as every script here touches several (a
# server that takes a PING but refuses writes, read-only after a failover, out of memory, without the
# permission, or a cluster that refuses keys of two slots in one script, is not back).
_PROBE = """
redis.call('SET', KEYS[1], '1', 'PX', 1000)
redis.call('SET', KEYS[2], '1', 'PX', 1000)
return 1
"""

_TIMEOUTS_DOWN = 3
_ALL_IDS = 2**53  # an ``upto`` above every reservation id (Lua numbers are doubles)


class RedisUnavailable(Exception):
    """Redis did not answer in time (or is known to be down): the caller applies ``on_failure``."""


class RedisUnsupported(Exception):
    """``redis.url`` names a server kvgate cannot use whatever it does: a Redis Cluster (every script here reads
    and writes several keys, which a cluster refuses unless they share a slot)."""


class RedisState:
    def __init__(
        self,
        cfg: RedisConfig,
        on_health: Callable[[bool], None] = lambda up: None,
        on_error: Callable[[], None] = lambda: None,
    ) -> None:
        assert cfg.url is not None
        self.cfg = cfg
        self.healthy = False
        self.replica_id = os.urandom(6).hex()
        self.errors = 0
        self._on_health = on_health
        self._on_error = on_error
        self._timeouts = 0
        self._client = aioredis.Redis.from_url(
            cfg.url,
            socket_timeout=cfg.timeout_s,
            socket_connect_timeout=cfg.timeout_s,
            retry_on_timeout=False,
            retry=None,
            health_check_interval=0,
        )
        self._check = self._client.register_script(_CHECK)
        self._refund = self._client.register_script(_REFUND)
        self._acquire = self._client.register_script(_ACQUIRE)
        self._release = self._client.register_script(_RELEASE)
        self._renew = self._client.register_script(_RENEW)
        self._claim = self._client.register_script(_CLAIM)
        self._restate = self._client.register_script(_RESTATE)
        self._write_probe = self._client.register_script(_PROBE)
        self._probe: asyncio.Task[None] | None = None
        self._last_refusal = ""
        self._closed = False

    def key(self, kind: str, name: str) -> str:
        return f"{self.cfg.key_prefix}:{kind}:{name}"

    # --- health -------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect, or go on without Redis (``on_failure``) and probe until it answers. Raises
        :class:`RedisUnsupported` for a cluster: a configuration to fix, not an outage to wait out."""
        try:
            await self._usable(max(self.cfg.timeout_s, 1.0))
        except (RedisError, OSError, TimeoutError) as exc:
            self._mark_down(exc)
            return
        self._set_health(True)

    async def _usable(self, timeout_s: float) -> None:
        """Raise unless Redis answers and takes the writes of a script of two keys (see :data:`_PROBE`)."""
        await asyncio.wait_for(self._client.ping(), timeout_s)
        try:
            cluster = await asyncio.wait_for(self._client.info("cluster"), timeout_s)
        except ResponseError:
            cluster = {}  # INFO may be denied (a managed Redis's ACL): the probe's two keys still tell
        if cluster.get("cluster_enabled"):
            raise RedisUnsupported(
                f"redis.url ({without_password(self.cfg.url or '')}) is a Redis Cluster: kvgate's scripts each "
                "read and write several keys, which a cluster refuses; use a standalone Redis (a primary, with "
                "replicas or Sentinel for failover)"
            )
        keys = [self.key("probe", self.replica_id), self.key("probe", self.replica_id + ":2")]
        try:
            await asyncio.wait_for(self._write_probe(keys=keys), timeout_s)
        except ResponseError as exc:
            if str(exc) != self._last_refusal:  # the server answers but refuses: say why, once per reason
                self._last_refusal = str(exc)
                log.warning("redis answers but refuses kvgate's writes: %s", exc)
            raise

    async def close(self) -> None:
        self._closed = True
        if self._probe is not None:
            self._probe.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._probe
        with contextlib.suppress(RedisError, OSError):
            await self._client.aclose()

    def _set_health(self, up: bool) -> None:
        if up != self.healthy:
            self.healthy = up
            log.warning("redis %s (%s)", "is back" if up else "is DOWN", without_password(self.cfg.url or ""))
            self._on_health(up)

    def _mark_down(self, exc: BaseException) -> None:
        self.errors += 1
        self._timeouts = 0
        log.debug("redis call failed: %r", exc)
        self._set_health(False)
        if (self._probe is None or self._probe.done()) and not self._closed:
            self._probe = asyncio.create_task(self._reconnect(), name="kvgate-redis-probe")

    async def _reconnect(self) -> None:
        """Probe until Redis answers; requests meanwhile take the fallback without waiting on Redis."""
        while not self._closed:
            await asyncio.sleep(self.cfg.reconnect_interval_s)
            with contextlib.suppress(RedisError, OSError):
                # Connections opened before the outage are dead (a restarted Redis does not know them):
                # drop them all, so the first request after recovery does not trip over one.
                await self._client.connection_pool.disconnect()
            try:
                await self._usable(max(self.cfg.timeout_s, 0.5))
                # A restarted Redis has an empty script cache: load them now, not on a request's time.
                for script in self._scripts():
                    await asyncio.wait_for(self._client.script_load(script.script), max(self.cfg.timeout_s, 0.5))
            except (RedisError, OSError, TimeoutError):
                continue
            except RedisUnsupported as exc:  # it became one since start-up: stay down, and say why
                log.error("%s", exc)
                continue
            except Exception:  # never let the probe die: nothing else would bring Redis back
                log.exception("redis probe failed")
                continue
            self._set_health(True)
            return

    def _scripts(self) -> tuple[AsyncScript, ...]:
        return (
            self._check,
            self._refund,
            self._acquire,
            self._release,
            self._renew,
            self._claim,
            self._restate,
            self._write_probe,
        )

    async def _call(self, op: Callable[[], Awaitable[T]]) -> T:
        """Run one Redis operation within ``timeout_s``. A refused connection marks Redis down at once; a
        slow answer only fails this call, unless it happens ``_TIMEOUTS_DOWN`` times in a row (a busy event
        loop can make one reply late without Redis being gone)."""
        if not self.healthy:
            raise RedisUnavailable
        try:
            # asyncio.timeout, not wait_for: on 3.11 wait_for swallows a cancellation that arrives as the reply
            # does, and a caller that was cancelled (its client left) would carry on with what it got.
            async with asyncio.timeout(self.cfg.timeout_s):
                result = await op()
        except TimeoutError as exc:
            self.errors += 1
            self._timeouts += 1
            self._on_error()
            if self._timeouts >= _TIMEOUTS_DOWN:
                self._mark_down(exc)
            raise RedisUnavailable from exc
        except (RedisError, OSError) as exc:
            self._on_error()
            self._mark_down(exc)
            raise RedisUnavailable from exc
        self._timeouts = 0
        return result

    # --- rate limits --------------------------------------------------------------------------------

    def _charge_key(self, key: str, charge: str) -> str:
        return self.key("rl-charge", f"{key}:{self.replica_id}:{charge}")

    async def check(self, key: str, limits: RateLimits, tokens: int, charge: str | None = None) -> RateDecision:
        """Charge one request and ``tokens``; ``charge`` names the charge (unique on this replica), so that a
        refund of it gives back at most what it took, once."""
        rpm, tpm = limits.requests_per_minute or 0, limits.tokens_per_minute or 0
        keys = [self.key("rl", key)] if charge is None else [self.key("rl", key), self._charge_key(key, charge)]
        args = [rpm, tpm, tokens, _CHARGE_RECORD_TTL_MS]
        out: list[Any] = await self._call(lambda: self._check(keys=keys, args=args))
        allowed = int(out[0]) == 1
        req_left, tok_left, req_wait, tok_wait = (float(x) for x in out[1:])
        tok_wait = math.inf if tok_wait < 0 else tok_wait
        exceeded = None if allowed else ("requests" if req_wait >= tok_wait else "tokens")
        return RateDecision(
            allowed,
            max(req_wait, tok_wait),
            _state(rpm, req_left),
            _state(tpm, tok_left),
            exceeded,
        )

    async def refund(
        self, key: str, limits: RateLimits, charge: str, tokens: float = 0, requests: float = 0, undo: bool = False
    ) -> None:
        """Give back what charge ``charge`` did not use (``tokens``, ``requests``), or all of it (``undo``: its
        answer never came); at most once, and never more than it took."""
        rpm, tpm = limits.requests_per_minute or 0, limits.tokens_per_minute or 0
        keys = [self.key("rl", key), self._charge_key(key, charge)]
        args = [rpm, tpm, requests, tokens, int(undo), _CHARGE_RECORD_TTL_MS]
        await self._call(lambda: self._refund(keys=keys, args=args))

    # --- concurrency slots --------------------------------------------------------------------------

    async def acquire(self, key: str, limit: int, member: str) -> bool:
        lease_ms = int(self.cfg.slot_lease_s * 1000)
        keys = [self.key("slots", key), self._release_mark(key, member)]
        got = await self._call(lambda: self._acquire(keys=keys, args=[limit, member, lease_ms]))
        return int(got) == 1

    async def release(self, key: str, member: str, *, mark: bool = False) -> None:
        """Give ``member``'s slot back; ``mark``: leave the release mark even if it was there (a renewal that
        carries it may still be on its way)."""
        lease_ms = int(self.cfg.slot_lease_s * 1000)
        keys = [self.key("slots", key), self._release_mark(key, member)]
        await self._call(lambda: self._release(keys=keys, args=[member, lease_ms, "1" if mark else "0"]))

    def _release_mark(self, key: str, member: str) -> str:
        return self.key("slot-released", f"{key}:{member}")

    async def renew(self, held: list[tuple[str, str]]) -> None:
        if not held:
            return
        lease_ms = int(self.cfg.slot_lease_s * 1000)
        keys = [self.key("slots", k) for k, _ in held] + [self._release_mark(k, m) for k, m in held]
        await self._call(lambda: self._renew(keys=keys, args=[lease_ms, *(m for _, m in held)]))

    # --- blocks in flight per engine, shared by the replicas -----------------------------------------

    def _engine_keys(self, engine: str) -> list[str]:
        # "engine-queued", not the "engine-waiting" of before classes were said: during a rolling upgrade old and
        # new replicas do not misread each other's queue (they only miss it, until the upgrade is done)
        kinds = ("engine-leases", "engine-blocks", "engine-sampled", "engine-queued", "engine-peak")
        return [self.key(kind, engine) for kind in kinds]

    async def claim_blocks(
        self,
        engine: str,
        member: str,
        blocks: int,
        limit: int,
        lease_s: float,
        mark: tuple[float, float] | None,
        waited_s: float = 0.0,
        priority: int = STANDARD,
    ) -> tuple[bool, int]:
        """``mark``: (process start, tokens) of the sample this replica's view rests on, None for none;
        ``waited_s``, ``priority``: how long the request has waited here, and its class (the other replicas'
        queued requests of a higher class, or of its class waiting longer, go first)."""
        args: list[str | int] = [
            f"{self.replica_id}:",
            f"{self.replica_id}:{member}",
            blocks,
            limit,
            int(lease_s * 1000),
            *_args(mark),
            int(waited_s * 1000),
            priority,
        ]
        out: list[Any] = await self._call(lambda: self._claim(keys=self._engine_keys(engine), args=args))
        return int(out[0]) == 1, int(out[1])

    async def restate_blocks(
        self,
        engine: str,
        held: dict[str, tuple[int, int]],
        lease_s: float,
        everything: bool,
        mark: tuple[float, float] | None,
        waiting: tuple[tuple[float, int, int], ...] = (),
        peak: tuple[int, int] | None = None,
        upto: int | None = None,
        waiting_ttl_s: float = 2.0,
    ) -> int:
        """``held``: member -> (blocks, of which the sample of ``mark`` shows); ``waiting``: the first requests of
        this replica's queue in serving order, (seconds waited, blocks, class) each, said for ``waiting_ttl_s``;
        ``peak``: (restate number, the most its reservations up to ``upto`` can hold at once), None for none;
        ``upto``: the newest reservation ``held`` and ``peak`` knew of (with ``everything``, members above it are
        not removed; None: all are)."""
        me = self.replica_id
        triples = [x for member, (blocks, shown) in held.items() for x in (f"{me}:{member}", blocks, shown)]
        queued = " ".join(f"{int(waited * 1000)} {blocks} {priority}" for waited, blocks, priority in waiting)
        head = f"{int(waiting_ttl_s * 1000)} {queued}" if waiting else ""
        args: list[str | int] = [
            f"{self.replica_id}:",
            int(lease_s * 1000),
            int(everything),
            *_args(mark),
            head,
            "" if peak is None else f"{peak[0]} {peak[1]}",
            _ALL_IDS if upto is None else upto,
            *triples,
        ]
        others = await self._call(lambda: self._restate(keys=self._engine_keys(engine), args=args))
        return int(others)


def _args(mark: tuple[float, float] | None) -> tuple[str, str]:
    """A sample mark as the scripts compare it: the process start time as text (both sides format the same
    parsed float, so equal starts are equal strings), the token count as a number."""
    return ("", "0") if mark is None else (repr(mark[0]), repr(mark[1]))


def _state(limit: int, left: float) -> LimitState | None:
    if limit <= 0:
        return None
    return LimitState(limit, max(0, math.floor(left)), (limit - left) * 60.0 / limit)


def without_password(url: str) -> str:
    """``url`` fit for a log line: its password (``redis://:secret@host``) replaced by ``***`` and its query
    left out (redis-py also takes ``?password=``)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    user = parts.username or ""
    userinfo = f"{user}:***@" if parts.password is not None else (f"{user}@" if user else "")
    netloc = userinfo + host + (f":{parts.port}" if parts.port is not None else "")
    return f"{parts.scheme}://{netloc}{parts.path}"
