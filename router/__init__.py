"""The router role: an aiohttp reverse proxy in front of the vLLM workers. It serves the OpenAI
routes, picks a worker per request (least outstanding, round robin or group affinity), health-checks
the pool it reads from Redis and retries only while nothing has reached the client yet."""
