-- wrk script for the queue section: every request POSTs a small form (one job) to a route that
-- queues it. With PACE_MS set, each connection waits that many milliseconds after every
-- answer, as in paced.lua; PACE_MS=0 is a closed loop. The report line comes from report.lua,
-- loaded from this script's own directory.

local here = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(here .. "report.lua")

wrk.method = "POST"
wrk.body = "action=subscribe&list=weekly&email=someone%40example.com"
wrk.headers["Content-Type"] = "application/x-www-form-urlencoded"

local pace_ms = tonumber(os.getenv("PACE_MS") or "0")

if pace_ms > 0 then
  function delay()
    return pace_ms
  end
end
