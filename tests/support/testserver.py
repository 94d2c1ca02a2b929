"""A real OpenAI-compatible HTTP server for tests, benchmarks and local trials.

It serves ``POST /v1/completions``, ``POST /v1/chat/completions`` and ``GET /v1/models`` over
HTTP (Starlette on uvicorn, both already installed with the Dagster webserver), and answers
either with a real local model (``--model DIR``: :class:`campaign_orchestrator.generation.local.LocalModel`, one
request at a time) or with a deterministic rule (``responder="cipher"``: the demo task's
answer for ``encode <word> =`` prompts, else the prompt reversed), after a fixed latency.

For testing clients it can also: require an API key (401 otherwise), refuse prompts longer than
a context length (400, like vLLM), and inject faults: a share of requests answered 429 (with
``Retry-After``) or 500, and a share that hang past the client's timeout. It counts every
request per prompt server-side; ``GET /stats`` returns the counts, ``POST /stats/reset``
clears them.

    python -m tests.support.testserver --port 8000 --latency-ms 50 --fail-429 0.1 --fail-500 0.1
    python -m tests.support.testserver --model artifacts/models/demo-*/teacher --served-name teacher
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route


@dataclass
class ServerConfig:
    latency_s: float = 0.05
    served_name: str = "teacher"
    responder: str = "cipher"  # "cipher" | "model"
    model_dir: str | None = None
    api_key: str | None = None
    context_length: int | None = None  # in whitespace-separated words for the rule responders
    fail_429: float = 0.0
    fail_500: float = 0.0
    timeout_rate: float = 0.0
    hang_s: float = 30.0  # how long a "timeout" fault holds the request before answering 504
    retry_after_s: float | None = 0.05
    seed: int = 0
    hold: threading.Event | None = None  # while set, answers wait; one whose client went away is never served
    release: set[str] = field(default_factory=set)  # prompts answered even while `hold` is set
    logprobs: bool = True  # False: an API that answers without log-probabilities whatever it is asked


@dataclass
class ServerStats:
    received: int = 0
    ok: int = 0
    by_status: Counter = field(default_factory=Counter)
    received_by_prompt: Counter = field(default_factory=Counter)
    ok_by_prompt: Counter = field(default_factory=Counter)
    in_flight: int = 0
    max_in_flight: int = 0
    held: int = 0  # answers waiting on ServerConfig.hold now
    held_by_prompt: Counter = field(default_factory=Counter)  # of them, per prompt
    dropped_by_prompt: Counter = field(default_factory=Counter)  # held requests whose client went away (499)
    served_prompt_tokens: int = 0  # the usage of every answer sent (what a provider bills)
    served_completion_tokens: int = 0

    def as_dict(self) -> dict:
        return {
            "received": self.received,
            "ok": self.ok,
            "by_status": {str(k): v for k, v in self.by_status.items()},
            "received_by_prompt": dict(self.received_by_prompt),
            "ok_by_prompt": dict(self.ok_by_prompt),
            "in_flight": self.in_flight,
            "max_in_flight": self.max_in_flight,
            "held": self.held,
            "held_by_prompt": {k: v for k, v in self.held_by_prompt.items() if v},
            "dropped_by_prompt": dict(self.dropped_by_prompt),
            "served_prompt_tokens": self.served_prompt_tokens,
            "served_completion_tokens": self.served_completion_tokens,
        }


def rule_answer(prompt: str) -> str:
    """The demo task's answer (``encode abc =`` -> `` <cipher>``), else the prompt reversed."""
    from campaign_orchestrator.demo import cipher

    parts = prompt.split()
    if len(parts) == 3 and parts[0] == "encode" and parts[2] == "=" and parts[1].isalpha() and parts[1].islower():
        return " " + cipher.encode(parts[1])
    return prompt[::-1]


def _fake_logprobs(tokens: list[str], k: int) -> list[dict[str, float]]:
    alphabet = "abcdefghijklmnopqrstuvwxyz "
    out = []
    for t in tokens:
        alts = [c for c in alphabet if c != t][: k - 1]
        d = {t: -0.05}
        d |= {a: -3.0 - i for i, a in enumerate(alts)}
        out.append(d)
    return out


def build_app(cfg: ServerConfig) -> tuple[Starlette, ServerStats]:
    stats = ServerStats()
    rng = random.Random(cfg.seed)
    gen_lock = threading.Lock()
    generator = None
    if cfg.responder == "model":
        from campaign_orchestrator.generation.local import LocalModel

        generator = LocalModel.from_path(cfg.model_dir, batch_size=1)

    def error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
        stats.by_status[status] += 1
        return JSONResponse(
            {"error": {"message": message, "type": "invalid_request_error", "code": status}},
            status_code=status,
            headers=headers,
        )

    async def answer(request: Request, chat: bool) -> JSONResponse:
        stats.received += 1
        stats.in_flight += 1
        stats.max_in_flight = max(stats.max_in_flight, stats.in_flight)
        try:
            return await _answer(request, chat)
        finally:
            stats.in_flight -= 1

    async def _answer(request: Request, chat: bool) -> JSONResponse:
        if cfg.api_key is not None and request.headers.get("authorization") != f"Bearer {cfg.api_key}":
            return error(401, "Incorrect API key provided.")
        try:
            body = json.loads(await request.body())
        except ValueError:
            return error(400, "body is not JSON")
        if body.get("model") != cfg.served_name:
            return error(404, f"The model `{body.get('model')}` does not exist.")
        if chat:
            msgs = body.get("messages") or []
            prompt = msgs[-1]["content"] if msgs else ""
        else:
            prompt = body.get("prompt", "")
        stats.received_by_prompt[prompt] += 1
        max_tokens = int(body.get("max_tokens") or 16)
        if cfg.context_length is not None and len(prompt.split()) + max_tokens > cfg.context_length:
            return error(
                400,
                f"This model's maximum context length is {cfg.context_length} tokens; the prompt "
                f"has {len(prompt.split())} plus {max_tokens} requested.",
            )
        roll = rng.random()
        if roll < cfg.timeout_rate:
            await asyncio.sleep(cfg.hang_s)
            return error(504, "upstream timed out")
        roll -= cfg.timeout_rate
        if roll < cfg.fail_429:
            headers = {"retry-after": f"{cfg.retry_after_s:g}"} if cfg.retry_after_s is not None else None
            return error(429, "Rate limit reached, retry later.", headers)
        roll -= cfg.fail_429
        if roll < cfg.fail_500:
            return error(500, "The server had an error while processing your request.")
        if cfg.hold is not None and cfg.hold.is_set() and prompt not in cfg.release:
            stats.held += 1
            stats.held_by_prompt[prompt] += 1
            try:
                while cfg.hold.is_set() and prompt not in cfg.release:
                    if await request.is_disconnected():
                        stats.dropped_by_prompt[prompt] += 1
                        return error(499, "client closed the request")  # never served, never billed
                    await asyncio.sleep(0.01)
            finally:
                stats.held -= 1
                stats.held_by_prompt[prompt] -= 1
        t0 = time.perf_counter()
        k = body.get("top_logprobs") if chat else body.get("logprobs")
        k = int(k) if k and not isinstance(k, bool) and cfg.logprobs else None
        if generator is not None:

            def run():
                with gen_lock:
                    return generator.generate(
                        [prompt],
                        max_tokens,
                        float(body.get("temperature") or 0.0),
                        float(body.get("top_p") or 1.0),
                        int(body.get("seed") or 0),
                        logprobs=k,
                    )[0]

            c = await asyncio.to_thread(run)
            if c.error:
                return error(400, c.error)
            text, finish, n_prompt, n_out = c.text, c.finish_reason, c.prompt_tokens, c.completion_tokens
            toks = [generator.tok.convert_ids_to_tokens(i) for i in (c.token_ids or [])]
            top = (
                [{generator.tok.convert_ids_to_tokens(e[0]): e[2] for e in pos} for pos in c.top_logprobs]
                if c.top_logprobs
                else None
            )
        else:
            full = rule_answer(prompt)
            text = full[:max_tokens]
            finish = "stop" if len(full) <= max_tokens else "length"
            n_prompt, n_out = len(prompt.split()), len(text) + (finish == "stop")
            toks = list(text) + (["</s>"] if finish == "stop" else [])
            top = _fake_logprobs(toks, k) if k else None
        await asyncio.sleep(max(0.0, cfg.latency_s - (time.perf_counter() - t0)))
        usage = {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}
        if chat:
            choice: dict = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
            if top is not None:
                choice["logprobs"] = {
                    "content": [
                        {
                            "token": t,
                            "logprob": pos.get(t, max(pos.values())),
                            "top_logprobs": [{"token": a, "logprob": v} for a, v in pos.items()],
                        }
                        for t, pos in zip(toks, top, strict=False)
                    ]
                }
        else:
            choice = {
                "index": 0,
                "text": text,
                "finish_reason": finish,
                "logprobs": None if top is None else {"tokens": toks, "top_logprobs": top},
            }
        stats.ok += 1
        stats.served_prompt_tokens += n_prompt
        stats.served_completion_tokens += n_out
        stats.by_status[200] += 1
        stats.ok_by_prompt[prompt] += 1
        return JSONResponse(
            {
                "id": f"cmpl-{stats.received}",
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": cfg.served_name,
                "choices": [choice],
                "usage": usage,
            }
        )

    async def completions(request: Request) -> JSONResponse:
        return await answer(request, chat=False)

    async def chat_completions(request: Request) -> JSONResponse:
        return await answer(request, chat=True)

    async def models(request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": cfg.served_name, "object": "model"}]})

    async def get_stats(request: Request) -> JSONResponse:
        d = stats.as_dict()
        if request.query_params.get("summary"):
            d = {k: v for k, v in d.items() if not k.endswith("_by_prompt")}
        return JSONResponse(d)

    async def reset_stats(request: Request) -> JSONResponse:
        fresh = ServerStats()
        for name in fresh.__dataclass_fields__:
            setattr(stats, name, getattr(fresh, name))
        return JSONResponse({"reset": True})

    app = Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/stats", get_stats, methods=["GET"]),
            Route("/stats/reset", reset_stats, methods=["POST"]),
        ]
    )
    return app, stats


class ServerThread:
    """Run the server on 127.0.0.1 in a background thread (a context manager)."""

    def __init__(self, cfg: ServerConfig | None = None, port: int = 0):
        import uvicorn

        self.cfg = cfg or ServerConfig()
        self.app, self.stats = build_app(self.cfg)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", port))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(
            uvicorn.Config(self.app, log_level="warning", access_log=False, timeout_graceful_shutdown=1, backlog=2048)
        )
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("test OpenAI server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


class ServerProcess:
    """Run the server as a separate process (its own CPU core), a context manager; ``stats()``
    reads the server-side counts over HTTP."""

    def __init__(self, *args: str, cwd: str | Path | None = None):
        import os
        import subprocess
        import tempfile

        self._dir = tempfile.mkdtemp(prefix="oai-server-")
        self._port_file = Path(self._dir) / "port"
        repo = Path(__file__).resolve().parents[2]
        env = os.environ | {"PYTHONPATH": str(repo) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self._cmd = [
            sys.executable,
            "-m",
            "tests.support.testserver",
            "--port",
            "0",
            "--port-file",
            str(self._port_file),
            *args,
        ]
        self._popen = lambda: subprocess.Popen(self._cmd, cwd=cwd or repo, env=env)
        self.proc = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def stats(self, summary: bool = False) -> dict:
        import urllib.request

        url = f"http://127.0.0.1:{self.port}/stats" + ("?summary=1" if summary else "")
        with urllib.request.urlopen(url, timeout=30) as r:
            return json.loads(r.read())

    def reset(self) -> None:
        import urllib.request

        urllib.request.urlopen(
            urllib.request.Request(f"http://127.0.0.1:{self.port}/stats/reset", method="POST"), timeout=30
        ).read()

    def __enter__(self) -> ServerProcess:
        self.proc = self._popen()
        deadline = time.monotonic() + 60
        while not self._port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"test OpenAI server did not start: {' '.join(self._cmd)}")
            time.sleep(0.05)
        self.port = int(self._port_file.read_text())
        return self

    def __exit__(self, *exc) -> None:
        import shutil

        self.proc.terminate()
        try:
            self.proc.wait(10)
        except Exception:
            self.proc.kill()
        shutil.rmtree(self._dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.support.testserver", description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000, help="0 picks a free port (see --port-file)")
    ap.add_argument("--port-file", help="write the bound port here once the server accepts connections")
    ap.add_argument("--latency-ms", type=float, default=50.0)
    ap.add_argument("--served-name", default="teacher")
    ap.add_argument("--model", help="serve this local checkpoint instead of the rule responder")
    ap.add_argument("--api-key", help="require this bearer key (401 otherwise)")
    ap.add_argument("--context-length", type=int)
    ap.add_argument("--fail-429", type=float, default=0.0)
    ap.add_argument("--fail-500", type=float, default=0.0)
    ap.add_argument("--timeout-rate", type=float, default=0.0)
    ap.add_argument("--hang-s", type=float, default=30.0)
    ap.add_argument("--retry-after-s", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    import uvicorn

    cfg = ServerConfig(
        latency_s=a.latency_ms / 1000,
        served_name=a.served_name,
        responder="model" if a.model else "cipher",
        model_dir=a.model,
        api_key=a.api_key,
        context_length=a.context_length,
        fail_429=a.fail_429,
        fail_500=a.fail_500,
        timeout_rate=a.timeout_rate,
        hang_s=a.hang_s,
        retry_after_s=a.retry_after_s,
        seed=a.seed,
    )
    app, _ = build_app(cfg)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((a.host, a.port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False, backlog=2048))

    def announce() -> None:
        while not server.started:
            time.sleep(0.01)
        if a.port_file:
            tmp = Path(a.port_file + ".tmp")
            tmp.write_text(str(sock.getsockname()[1]))
            tmp.replace(a.port_file)
        print(f"serving http://{a.host}:{sock.getsockname()[1]}/v1", file=sys.stderr, flush=True)

    threading.Thread(target=announce, daemon=True).start()
    server.run(sockets=[sock])  # uvicorn's loop setup (uvloop when installed: no delayed-ACK stalls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
