-- wrk script for the limiter-latency section: each connection waits PACE_MS milliseconds
-- after every answer before its next request, so the load stays well below what one proxy core
-- can do (a closed loop of even 8 connections saturates it, and then the measured latency is
-- queueing, not the cost of the Redis round trip). The report line comes from report.lua,
-- loaded from this script's own directory.

local here = debug.getinfo(1, "S").source:match("^@(.*/)") or "./"
dofile(here .. "report.lua")

local pace_ms = tonumber(os.getenv("PACE_MS") or "1")

function delay()
  return pace_ms
end
