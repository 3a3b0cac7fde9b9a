-- levee rate limits: GCRA for every rule of one request, all or nothing, on the Redis clock.
--
-- KEYS[i]: the bucket of rule i.
-- ARGV[3i-2]: interval between tokens (microseconds); ARGV[3i-1]: burst; ARGV[3i]: "1" if
-- the rule is a dry run (counted, never blocks, never charged when over).
--
-- A bucket is one string: the theoretical arrival time (TAT) of the next request in
-- microseconds. It expires by itself once the bucket would be full again.
--
-- Returns one string of space-separated integers: blocked, then per rule: allowed,
-- remaining, reset_ms, retry_after_ms. (One bulk string costs the client far less to read
-- than an array of integers, on every request.)
-- When any non-dry-run rule refuses, nothing is written: a request denied by one rule does
-- not use up the tokens of the others.
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local out = { 0 }
local new_tats = {}
local blocked = false
for i = 1, #KEYS do
  local interval = tonumber(ARGV[3 * i - 2])
  local burst = tonumber(ARGV[3 * i - 1])
  local dry_run = ARGV[3 * i] == '1'
  local tat = tonumber(redis.call('GET', KEYS[i]))
  if tat == nil or tat < now then
    tat = now
  end
  local new_tat = tat + interval
  local capacity = interval * burst
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
if blocked then
  out[1] = 1
else
  for i = 1, #KEYS do
    if new_tats[i] then
      local ttl = math.max(1, math.ceil((new_tats[i] - now) / 1000))
      redis.call('SET', KEYS[i], string.format('%.0f', new_tats[i]), 'PX', ttl)
    end
  end
end
-- Every value is a whole number below 2^53, which %d writes exactly.
local text = {}
for i = 1, #out do
  text[i] = string.format('%d', out[i])
end
return table.concat(text, ' ')
