-- wrk script for bench/router_overhead.sh: POST a small /v1/completions body. MAX_TOKENS (default
-- 1) and STREAM (true / false, default false) come from the environment. The same body goes to duet-http-echo's
-- /echo for the bare-server baseline. No response() hook: it would make wrk hand every body to
-- Lua; non-2xx answers are counted by wrk itself ("Non-2xx or 3xx responses").
local max_tokens = os.getenv("MAX_TOKENS") or "1"
local stream = os.getenv("STREAM") or "false"
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"m","prompt":"the quick brown fox jumps over the lazy dog","max_tokens":'
    .. max_tokens .. ',"stream":' .. stream .. '}'
