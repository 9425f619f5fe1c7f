"""The router role: an aiohttp reverse proxy in front of the vLLM workers. It serves the OpenAI
routes, picks a worker per request (least outstanding, round robin or group affinity), health-checks
the pool it reads from Redis and retries only while nothing has reached the client yet.

Modules: `server` (HTTP layer, `Router` lifecycle, `main` for `ROLE=router slipstream run`), `proxy`
(the per-request hot path: body, worker choice, retries, relaying), `upstream` (the keep-alive
HTTP/1.1 client to the workers), `pool` (workers from Redis plus health checks), `policy` (pure
worker choice), `metrics` (Prometheus text). Other roles find a running router through Redis: the
key `Keys(exp).router(name)` holds its base URL as a plain string (e.g. `http://127.0.0.1:41234`)
while its heartbeat keeps the key alive; clients send OpenAI requests to `<url>/v1/...`, optionally
with the header `X-Slipstream-Group` (or the body field `slipstream_group`) to keep a prompt group's
samples on one worker.
"""
