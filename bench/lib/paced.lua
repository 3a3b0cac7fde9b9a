-- wrk script for the limiter-latency section: each connection waits PACE_MS milliseconds
-- after every answer before its next request, so the load stays well below what one proxy core
-- can do (a closed loop of even 8 connections saturates it, and then the measured latency is
-- queueing, not the cost of the Redis round trip). Prints the same BENCH line as report.lua.

local pace_ms = tonumber(os.getenv("PACE_MS") or "1")

function delay()
  return pace_ms
end

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "BENCH requests=%d duration_us=%d bytes=%d err_connect=%d err_read=%d err_write=%d "
      .. "err_status=%d err_timeout=%d p50_us=%d p90_us=%d p99_us=%d p999_us=%d max_us=%d\n",
    summary.requests, summary.duration, summary.bytes,
    e.connect, e.read, e.write, e.status, e.timeout,
    latency:percentile(50), latency:percentile(90), latency:percentile(99),
    latency:percentile(99.9), latency.max))
end
