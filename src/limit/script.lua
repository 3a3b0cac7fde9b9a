-- levee rate limits: GCRA for a batch of requests, each request's rules all or nothing, on
-- the Redis clock. The requests are decided in order, so a batch gives exactly the answers
-- the same requests would get one call each.
--
-- KEYS: the buckets of every rule of every request, in order.
-- ARGV[1]: the number of requests. Then per request: its number of rules n; `ahead`; then per
-- rule the interval between tokens (microseconds), the burst, and "1" if the rule is a dry
-- run (counted, never blocks, never charged when over).
--
-- `ahead` is 0 for a request waiting for its decision. Above 0 it is a number of requests
-- levee already admitted (`[redis] admit_ahead_above`) with these same buckets: they are
-- charged together, always, but never past a full bucket; nothing is refused.
--
-- A bucket is one string: the theoretical arrival time (TAT) of the next request in
-- microseconds. It expires by itself once the bucket would be full again.
--
-- Returns one string of space-separated integers: per request, blocked (for `ahead`: how
-- many of the requests did not fit), then per rule: allowed, remaining, reset_ms,
-- retry_after_ms. (One bulk string costs the client far less to read than an array of
-- integers.)
-- When any non-dry-run rule of a waiting request refuses, nothing of that request is
-- written: a request denied by one rule does not use up the tokens of the others.
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local text = {}
local key = 0
local arg = 2
for _ = 1, tonumber(ARGV[1]) do
  local rules = tonumber(ARGV[arg])
  local ahead = tonumber(ARGV[arg + 1])
  arg = arg + 2
  local out = { 0 }
  local new_tats = {}
  local blocked = false
  for i = 1, rules do
    local interval = tonumber(ARGV[arg])
    local burst = tonumber(ARGV[arg + 1])
    local dry_run = ARGV[arg + 2] == '1'
    arg = arg + 3
    local tat = tonumber(redis.call('GET', KEYS[key + i]))
    if tat == nil or tat < now then
      tat = now
    end
    local capacity = interval * burst
    -- Further out than an empty bucket: left by a stricter rule before the policy was
    -- loosened; empty under this one, and kept so, so that it refills from now at this
    -- rule's rate even while its requests are refused.
    if tat > now + capacity then
      tat = now + capacity
      redis.call('SET', KEYS[key + i], string.format('%.0f', tat), 'PX', math.max(1, math.ceil(capacity / 1000)))
    end
    if ahead > 0 then
      -- Already admitted: charge them all, up to a full bucket, and say how many overran.
      local new_tat = tat + ahead * interval
      local over = math.max(0, math.ceil((new_tat - now - capacity) / interval))
      if over > 0 then
        new_tat = now + capacity
      end
      if not dry_run then
        out[1] = math.max(out[1], math.min(over, ahead))
      end
      new_tats[i] = new_tat
      table.insert(out, over > 0 and 0 or 1)
      table.insert(out, math.floor((capacity - (new_tat - now)) / interval))
      table.insert(out, math.ceil((new_tat - now) / 1000))
      table.insert(out, 0)
    else
      local new_tat = tat + interval
      local used = new_tat - now
      if used > capacity then
        new_tats[i] = false
        if not dry_run then
          blocked = true
        end
        table.insert(out, 0)
        table.insert(out, 0)
        table.insert(out, math.ceil((tat - now) / 1000))
        table.insert(out, math.ceil((used - capacity) / 1000))
      else
        new_tats[i] = new_tat
        table.insert(out, 1)
        table.insert(out, math.floor((capacity - used) / interval))
        table.insert(out, math.ceil(used / 1000))
        table.insert(out, 0)
      end
    end
  end
  if blocked then
    out[1] = 1
  else
    for i = 1, rules do
      if new_tats[i] then
        local ttl = math.max(1, math.ceil((new_tats[i] - now) / 1000))
        redis.call('SET', KEYS[key + i], string.format('%.0f', new_tats[i]), 'PX', ttl)
      end
    end
  end
  key = key + rules
  -- Every value is a whole number below 2^53, which %d writes exactly.
  for i = 1, #out do
    text[#text + 1] = string.format('%d', out[i])
  end
end
return table.concat(text, ' ')
