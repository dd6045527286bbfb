"""langchain-openai against the HTTP API (run in the clients' venv by bench/clients.py).

Usage: python langchain_check.py BASE_URL MODEL_ID. Prints one JSON line {"ok", "reason"}.

Checks: `OpenAI(...).batch([...])` of 3 prompts (langchain sends them as one completions
request with a list of prompts) returns 3 strings, the same on a second call (temperature 0);
`ChatOpenAI(...).invoke(...)` (its default: /v1/chat/completions) returns an AIMessage whose
usage metadata counts at least one output token.
"""

from __future__ import annotations

import json
import sys

from langchain_openai import ChatOpenAI, OpenAI


def check(base_url: str, model: str) -> tuple[bool, str]:
    llm = OpenAI(base_url=base_url, api_key="unused", model=model, max_tokens=8, temperature=0,
                 timeout=120, max_retries=0)
    prompts = ["import os\n", "def main():", "The license"]
    outs = llm.batch(prompts)
    if len(outs) != 3 or not all(isinstance(o, str) for o in outs):
        return False, f"OpenAI.batch of 3 prompts gave {outs!r}"
    if llm.batch(prompts) != outs:
        return False, "OpenAI.batch at temperature 0 gave other texts the second time"
    chat = ChatOpenAI(base_url=base_url, api_key="unused", model=model, max_tokens=8, temperature=0,
                      timeout=120, max_retries=0)
    msg = chat.invoke("Say hello.")
    used = (msg.usage_metadata or {}).get("output_tokens", 0)
    if not isinstance(msg.content, str) or used < 1:
        return False, f"ChatOpenAI.invoke gave {msg!r}"
    return True, f"OpenAI.batch: 3 completions {[len(o) for o in outs]} chars, replayed; ChatOpenAI.invoke: {used} tokens"


def main() -> None:
    try:
        ok, reason = check(sys.argv[1], sys.argv[2])
    except Exception as exc:  # the client's own error types: report any of them as the reason
        ok, reason = False, f"{type(exc).__name__}: {exc}"
    print(json.dumps({"ok": ok, "reason": reason}))


if __name__ == "__main__":
    main()
