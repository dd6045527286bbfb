"""The HTTP clients' rows of `bench.clients`: openai, langchain, lm-eval, guidellm, aiperf.

Every client runs unmodified from the clients' own virtual environment (`client_kit.client_venv`,
the pins in `client_kit.PYTHON_CLIENTS`), as a new user runs it: the Python packages through a
check script of bench/client_scripts/, the command-line tools (lm_eval, guidellm, aiperf) with
their own flags, pointed at the stack's HTTP API, with the bundled model's folder as their
tokenizer. Hub access is off (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE): nothing is downloaded
but the packages. Each row reports what it checked, or the first failure.

* `openai`: bench/client_scripts/openai_check.py (completions batched, n, seeded, logprobs,
  streamed; chat streamed; response_format json_schema).
* `langchain`: bench/client_scripts/langchain_check.py (`OpenAI.batch`, `ChatOpenAI.invoke`).
* `lm-eval`: `lm_eval --model local-completions` on two local tasks (bench/lm_eval_tasks/):
  dspark_gen (generate_until) and dspark_mc (multiple_choice, scored with echo prompt
  logprobs), then `bench.lm_eval_score` scores dspark_mc in process from the model's logits
  and compares item by item; plus `local-chat-completions` on dspark_gen.
* `guidellm`: `guidellm benchmark` with its default (chat) request type, 5 synchronous
  requests; its report is read for the successful requests and their output tokens (it exits
  0 even when every request failed).
* `aiperf`: `aiperf profile` with its default chat endpoint, 5 streamed requests; its export
  is read for the request count, the errors and the output tokens.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import urllib.request
from pathlib import Path

from bench.client_kit import (BUNDLED, CLIENT_TIMEOUT_S, REPO_ROOT, Row, Target, client, client_venv,
                              project_python, result_line, run, tail, versions)

HTTP_ROWS = ("openai", "langchain", "lm-eval", "guidellm", "aiperf")  # the rows this module registers
SCRIPTS = REPO_ROOT / "bench" / "client_scripts"
LM_EVAL_TASKS = REPO_ROOT / "bench" / "lm_eval_tasks"
REQUESTS = 5              # guidellm's and aiperf's request count
PROMPT_TOKENS, OUTPUT_TOKENS = 32, 8  # their synthetic requests' sizes


def offline_env(folder: Path) -> dict:
    """Our environment with the Hugging Face hubs off and their caches under `folder`."""
    return dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                HF_HOME=str(folder / "hf"), TOKENIZERS_PARALLELISM="false")


def tokenizer_folder(target: Target) -> Path:
    """The folder the clients load their tokenizer from: the served checkpoint's (the bundled
    one for the random tiny model, whose own tokenizer has no folder: counts then differ)."""
    return (target.checkpoint or BUNDLED).resolve()


def _python(folder: Path) -> Path:
    """The clients' venv python (the venv sits beside the rows' folders, in the workdir)."""
    return client_venv(folder.parent)


def _script_row(name: str, script: str, target: Target, folder: Path, dists: list[str]) -> Row:
    """Row `name` from bench/client_scripts/`script` run by the clients' python with the HTTP
    base URL and the model id, its reason followed by the versions of `dists`. Raises
    subprocess.TimeoutExpired: the script ran past CLIENT_TIMEOUT_S."""
    python = _python(folder)
    folder.mkdir(parents=True, exist_ok=True)
    res = run([str(python), str(SCRIPTS / script), target.http_base_url, target.model_id], folder,
              CLIENT_TIMEOUT_S, offline_env(folder))
    row = result_line(name, res)
    return Row(row.client, row.works, f"{row.reason}; {versions(python, dists)}")


@client("openai")
def openai_row(target: Target, folder: Path) -> Row:
    """The `openai` package (bench/client_scripts/openai_check.py)."""
    return _script_row("openai", "openai_check.py", target, folder, ["openai"])


@client("langchain")
def langchain_row(target: Target, folder: Path) -> Row:
    """langchain-openai (bench/client_scripts/langchain_check.py)."""
    return _script_row("langchain", "langchain_check.py", target, folder, ["langchain-openai", "langchain-core"])


# ---------------------------------------------------------------------------- lm-eval
def _lm_eval(python: Path, folder: Path, model: str, model_args: dict, task: str, extra: list[str]) -> Path:
    """One `lm-eval run` of `task` (from bench/lm_eval_tasks/, run there so the YAML's
    data_files resolve) with --log_samples; returns the samples file.

    Raises:
        RuntimeError: lm-eval failed (the server's refusal it logged, else its output's tail).
    """
    out = folder / f"out-{model}-{task}"
    args = ",".join(f"{k}={v}" for k, v in model_args.items())
    cmd = [str(python), "-m", "lm_eval", "run", "--model", model, "--model_args", args, "--tasks", task,
           "--include_path", str(LM_EVAL_TASKS), "--output_path", str(out), "--log_samples", *extra]
    res = run(cmd, LM_EVAL_TASKS, CLIENT_TIMEOUT_S, offline_env(folder))
    if res.returncode != 0:
        refusal = [line for line in res.stderr.splitlines() if "API request failed" in line]
        raise RuntimeError(f"lm-eval {model} {task} exit {res.returncode}: "
                           f"{(refusal[-1].split('message: ')[-1] if refusal else tail(res.stderr))[:300]}")
    found = sorted(glob.glob(str(out / "**" / f"samples_{task}_*.jsonl"), recursive=True))
    if not found:
        raise RuntimeError(f"lm-eval {model} {task}: no samples file under {out}")
    return Path(found[-1])


def _metric(samples: Path, metric: str) -> tuple[float, int]:
    """(mean of `metric` over the samples, item count)."""
    docs = [json.loads(line) for line in samples.read_text().splitlines() if line.strip()]
    return sum(float(d[metric]) for d in docs) / max(len(docs), 1), len(docs)


@client("lm-eval")
def lm_eval_row(target: Target, folder: Path) -> Row:
    """lm-eval's local-completions (generate_until + multiple_choice, the latter checked against
    the in-process scores of `bench.lm_eval_score`) and local-chat-completions (generate_until)."""
    python = _python(folder)
    folder.mkdir(parents=True, exist_ok=True)
    completions = {"model": target.model_id, "base_url": f"{target.http_base_url}/completions",
                   "tokenizer": tokenizer_folder(target), "tokenizer_backend": "huggingface",
                   "num_concurrent": 1, "max_retries": 1}
    chat = {"model": target.model_id, "base_url": f"{target.http_base_url}/chat/completions",
            "num_concurrent": 1, "max_retries": 1}
    done, failed = [], []
    steps = [("gen", "local-completions", completions, "dspark_gen", ["--batch_size", "2"]),
             ("chat gen", "local-chat-completions", chat, "dspark_gen", ["--apply_chat_template"]),
             ("mc", "local-completions", completions, "dspark_mc", ["--batch_size", "2"])]
    for label, model, args, task, extra in steps:
        try:
            samples = _lm_eval(python, folder, model, args, task, extra)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            failed.append(f"{label}: {exc}")
            continue
        if task == "dspark_gen":
            value, n = _metric(samples, "exact_match")
            done.append(f"{label} ({model}): {n} items, exact_match {value:.3f}")
            continue
        check = run([project_python(), "-m", "bench.lm_eval_score", "--samples", str(samples), "--checkpoint",
                     str(tokenizer_folder(target)), "--numerics", target.numerics],
                    REPO_ROOT, CLIENT_TIMEOUT_S)
        row = result_line("mc", check)
        (done if row.works else failed).append(f"mc ({model}) vs in-process: {row.reason}")
    reason = "; ".join(failed + done) + f"; {versions(python, ['lm-eval'])}"
    return Row("lm-eval", not failed, reason)


# ---------------------------------------------------------------------------- guidellm, aiperf
def _tokenized_count(target: Target, messages: list[dict]) -> int:
    """The prompt tokens the server counts for chat `messages`: POST /tokenize (rendered with
    the chat template, as chat renders them). Raises OSError: the request failed."""
    body = json.dumps({"model": target.model_id, "messages": messages, "add_generation_prompt": True}).encode()
    req = urllib.request.Request(f"{target.http_root}/tokenize", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return int(json.loads(resp.read())["count"])


def _token_check(target: Target, per_request: list[tuple[list[dict], int, int, int]],
                 max_tokens: int, ignore_eos: bool) -> tuple[str | None, int]:
    """Per request (messages, server prompt tokens, server completion tokens, the client's own
    count of the output): the server's prompt count must equal /tokenize of the same messages
    (the template's tokens included, which a client counting the raw text leaves out); its
    completion count must be max_tokens when the request ignored eos, else 1..max_tokens. The
    client's count re-tokenizes the decoded output text, which can merge tokens across the
    generated ones' boundaries, so it is reported, not required equal.
    Returns (the first mismatch or None, how many client counts differ from the server's)."""
    differ = 0
    for i, (messages, prompt, completion, counted) in enumerate(per_request):
        expected = _tokenized_count(target, messages)
        if prompt != expected:
            return f"request {i}: usage prompt {prompt} vs /tokenize {expected}", differ
        allowed = (max_tokens,) if ignore_eos else range(1, max_tokens + 1)
        if completion not in allowed:
            return f"request {i}: usage completion {completion} (max_tokens {max_tokens})", differ
        differ += int(counted != completion)
    return None, differ


@client("guidellm")
def guidellm_row(target: Target, folder: Path) -> Row:
    """`guidellm run` with its default request type (chat completions), REQUESTS synchronous
    synthetic requests; the JSON report must show every request successful."""
    python = _python(folder)
    folder.mkdir(parents=True, exist_ok=True)
    report = folder / "benchmarks.json"
    report.unlink(missing_ok=True)
    cmd = [str(python.parent / "guidellm"), "run",
           "--backend", f"kind=openai_http,target={target.http_root},model={target.model_id}",
           "--profile", "kind=synchronous", "--constraint", f"kind=max_requests,count={REQUESTS}",
           "--tokenizer", f"kind=huggingface_auto,model={tokenizer_folder(target)}",
           "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
           "--output", f"kind=json,path={report}", "--disable-console-interactive"]
    res = run(cmd, folder, CLIENT_TIMEOUT_S, offline_env(folder))
    version = versions(python, ["guidellm"])
    if res.returncode != 0 or not report.exists():
        return Row("guidellm", False, f"exit {res.returncode}: {tail(res.stderr or res.stdout)}; {version}")
    bench = json.loads(report.read_text())["benchmarks"][0]
    totals = bench["metrics"]["request_totals"]
    ok_requests = bench["requests"]["successful"]
    if totals["successful"] != REQUESTS or totals["errored"] or totals["incomplete"]:
        errors = [r["info"].get("error") for r in bench["requests"].get("errored") or []]
        return Row("guidellm", False, f"exit 0 but requests {totals} (errors: {errors[:1]}); {version}")
    shapes = [(json.loads(r["request_args"])["body"]["messages"], r["prompt_tokens"], r["output_tokens"],
               r["output_metrics"]["text_tokens"]) for r in ok_requests]
    problem, differ = _token_check(target, shapes, OUTPUT_TOKENS, ignore_eos=True)  # guidellm sends ignore_eos
    if problem is not None:
        return Row("guidellm", False, f"token counts: {problem}; {version}")
    return Row("guidellm", True, f"{REQUESTS}/{REQUESTS} chat requests successful, "
                                 f"{sum(r['output_tokens'] for r in ok_requests)} output tokens; usage prompt "
                                 f"tokens = /tokenize of the messages, completion = {OUTPUT_TOKENS} each "
                                 f"(guidellm's re-count differs on {differ}); {version}")


@client("aiperf")
def aiperf_row(target: Target, folder: Path) -> Row:
    """`aiperf profile` with its default endpoint type (chat), REQUESTS streamed synthetic
    requests; its export must show every request completed without errors.

    aiperf 0.13 cannot load a tokenizer from a local folder with HF_HUB_OFFLINE set (it then
    looks the path up in the hub cache only), so it runs with the hub on; a local folder is
    read from disk all the same (aiperf's alias lookup skips paths).
    """
    python = _python(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / "out"
    cmd = [str(python.parent / "aiperf"), "profile", "--model", target.model_id, "--url", target.http_root,
           "--streaming", "--request-count", str(REQUESTS), "--concurrency", "1",
           "--tokenizer", str(tokenizer_folder(target)), "--isl", str(PROMPT_TOKENS), "--osl", str(OUTPUT_TOKENS),
           "--artifact-dir", str(out), "--ui", "none"]
    env = {k: v for k, v in offline_env(folder).items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    res = run(cmd, folder, CLIENT_TIMEOUT_S, env)
    version = versions(python, ["aiperf"])
    export = out / "profile_export_aiperf.json"
    if res.returncode != 0 or not export.exists():
        return Row("aiperf", False, f"exit {res.returncode}: {tail(res.stdout + res.stderr)}; {version}")
    summary = json.loads(export.read_text())
    completed = int(summary.get("completed_request_count", {}).get("avg", 0))
    if completed != REQUESTS or summary.get("error_summary"):
        return Row("aiperf", False, f"{completed}/{REQUESTS} completed, errors {summary.get('error_summary')}; "
                                    f"{version}")
    inputs = {s["session_id"]: s["payloads"][0]["messages"]
              for s in json.loads((out / "inputs.json").read_text())["data"]}
    records = [json.loads(line) for line in (out / "profile_export.jsonl").read_text().splitlines() if line]
    shapes = [(inputs[r["metadata"]["conversation_id"]], r["metrics"]["usage_prompt_tokens"]["value"],
               r["metrics"]["usage_completion_tokens"]["value"], r["metrics"]["output_token_count"]["value"])
              for r in records]
    problem, differ = _token_check(target, shapes, OUTPUT_TOKENS, ignore_eos=False)
    if problem is not None:
        return Row("aiperf", False, f"token counts: {problem}; {version}")
    return Row("aiperf", True, f"{completed}/{REQUESTS} streamed chat requests, no errors; usage prompt tokens = "
                               f"/tokenize of the messages (aiperf's own count leaves the chat template out); "
                               f"completion tokens 1..{OUTPUT_TOKENS}, aiperf's re-tokenized count differs on "
                               f"{differ} of {completed}; {version}")
