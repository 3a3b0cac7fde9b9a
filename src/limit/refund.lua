-- Gives back one token per key (Redis Cluster only: when rules of one request live in
-- different slots and a later group refused, the groups that were charged are refunded).
-- KEYS[i]: bucket; ARGV[i]: interval in microseconds.
for i = 1, #KEYS do
  local tat = tonumber(redis.call('GET', KEYS[i]))
  if tat ~= nil then
    redis.call('SET', KEYS[i], string.format('%.0f', tat - tonumber(ARGV[i])), 'KEEPTTL')
  end
end
return #KEYS
