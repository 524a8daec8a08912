"""In-cluster load generator (runs inside the SuperInfer image as a Job; prints one JSON line).

python load.py URL MODEL CONCURRENCY SECONDS [MAX_TOKENS]
"""

import asyncio
import json
import sys
import time

import aiohttp


async def main(url: str, model: str, concurrency: int, seconds: float, max_tokens: int) -> dict:
    ok = failed = 0
    errors: dict[str, int] = {}
    deadline = time.monotonic() + seconds

    async def client(http: aiohttp.ClientSession) -> None:
        nonlocal ok, failed
        while time.monotonic() < deadline:
            body = {"model": model, "prompt": "Explain SLO-aware scheduling.", "max_tokens": max_tokens}
            try:
                async with http.post(f"{url}/v1/completions", json=body) as resp:
                    await resp.read()
                    if resp.status == 200:
                        ok += 1
                        continue
                    key = f"http {resp.status}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                key = type(exc).__name__
            failed += 1
            errors[key] = errors.get(key, 0) + 1
            await asyncio.sleep(0.2)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
    return {"ok": ok, "failed": failed, "errors": errors}


if __name__ == "__main__":
    url, model, conc, secs = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    tokens = int(sys.argv[5]) if len(sys.argv) > 5 else 32
    print(json.dumps(asyncio.run(main(url, model, conc, secs, tokens))), flush=True)
