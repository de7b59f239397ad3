"""Run in the vLLM environment by the tests: vLLM's own benchmark client (the request function
`vllm bench serve` uses for streamed `/v1/completions`) against a server.

Usage: python tests/vllm_bench_client.py URL MODEL MAX_TOKENS CONCURRENCY < prompts.json;
prints `RESULT` and a JSON list of {success, text, error}, one per prompt, in order.
"""

import asyncio
import json
import sys


async def run(url: str, model: str, max_tokens: int, concurrency: int, prompts: list[str]) -> list[dict]:
    import aiohttp
    from vllm.benchmarks.lib.endpoint_request_func import (
        AIOHTTP_TIMEOUT,
        RequestFuncInput,
        async_request_openai_completions,
    )

    gate = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(timeout=AIOHTTP_TIMEOUT, connector=connector) as session:

        async def one(prompt: str) -> dict:
            async with gate:
                req = RequestFuncInput(prompt=prompt, api_url=url, prompt_len=0, output_len=max_tokens, model=model)
                out = await async_request_openai_completions(req, session)
            return {"success": out.success, "text": out.generated_text, "error": out.error}

        return await asyncio.gather(*(one(p) for p in prompts))


def main() -> None:
    url, model, max_tokens, concurrency = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    results = asyncio.run(run(url, model, max_tokens, concurrency, json.load(sys.stdin)))
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
