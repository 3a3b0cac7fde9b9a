-- wrk script used by bench/run.sh for every load run.
-- wrk's own --latency table stops at p99; this prints one machine-readable line with the
-- counts, socket/status errors and the percentiles (microseconds) including p99.9.
-- No request()/response() hooks: they would slow wrk down and skew the numbers.

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
