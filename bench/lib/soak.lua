-- wrk script for bench/soak.sh: every request comes from one of SOAK_CLIENTS client addresses
-- (sent as X-Forwarded-For from the trusted loopback peer, as the front nginx would) and one
-- of SOAK_CLIENTS users, rotating through all of them, at a throttled steady rate.
-- It counts answers by status so the soak can tell limits (429) from real errors.

local clients = tonumber(os.getenv("SOAK_CLIENTS") or "100000")
local delay_ms = tonumber(os.getenv("SOAK_DELAY_MS") or "10")
local threads = {}
local counter = 0
-- A global, not a local: done() reads it from every thread with thread:get.
statuses = {}

function setup(thread)
  thread:set("id", #threads)
  table.insert(threads, thread)
end

function init(args)
  -- Each thread walks its own stride through the population so all threads together cover it.
  counter = id * 7919
  statuses = {}
end

local function address(n)
  -- wrk runs LuaJIT (Lua 5.1): no bit operators, so plain arithmetic.
  return string.format("10.%d.%d.%d", math.floor(n / 65536) % 256, math.floor(n / 256) % 256, n % 256)
end

function request()
  counter = counter + 1
  local client = counter % clients
  -- The user walks the population at another stride, so pairs (ip, user) keep changing.
  local user = "u" .. ((counter * 31) % clients)
  -- Every 50th request is one hot user, far over its per-user limit: the soak's 429s.
  if counter % 50 == 0 then
    user = "hot"
  end
  return wrk.format("GET", "/item?id=" .. (counter % 1000), {
    ["Host"] = "soak.test",
    ["X-Forwarded-For"] = address(client),
    ["X-User"] = user,
  })
end

function delay()
  return delay_ms
end

function response(status, headers, body)
  local key = tostring(status)
  statuses[key] = (statuses[key] or 0) + 1
end

function done(summary, latency, requests)
  local total = {}
  for _, thread in ipairs(threads) do
    local counts = thread:get("statuses") or {}
    for status, count in pairs(counts) do
      total[status] = (total[status] or 0) + count
    end
  end
  local parts = {}
  for status, count in pairs(total) do
    table.insert(parts, string.format("s%s=%d", status, count))
  end
  table.sort(parts)
  local e = summary.errors
  io.write(string.format(
    "SOAK requests=%d duration_us=%d err_connect=%d err_read=%d err_write=%d err_timeout=%d "
      .. "p50_us=%d p99_us=%d max_us=%d %s\n",
    summary.requests, summary.duration, e.connect, e.read, e.write, e.timeout,
    latency:percentile(50), latency:percentile(99), latency.max, table.concat(parts, " ")))
end
