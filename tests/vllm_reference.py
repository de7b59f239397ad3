"""Run in the vLLM environment by the tests: greedy completions from vLLM's own `LLM.generate`.

Usage: python tests/vllm_reference.py MODEL_DIR MAX_TOKENS < prompts.json; prints a JSON list.
"""

import json
import os
import sys


def main() -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams

    model, max_tokens = sys.argv[1], int(sys.argv[2])
    prompts = json.load(sys.stdin)
    llm = LLM(model=model, enforce_eager=True, dtype="float32")
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    print("RESULT " + json.dumps([o.outputs[0].text for o in outs]), flush=True)


if __name__ == "__main__":
    main()
